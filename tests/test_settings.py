"""Settings declared once (mm_grpo/settings.py): the flag, its parsing and its checks come from the field."""
import argparse
import dataclasses
import pickle
from typing import Literal, Optional, Tuple

import pytest

from mm_grpo.settings import (Count, Expanded, accept_negative_numbers, add_setting_args, check_bounds, check_keys,
                              expand_variables, from_args, read_block, setting)
from mm_grpo.training import arguments


@dataclasses.dataclass(frozen=True)
class Example:
    steps: int = setting(16, "denoising steps", minimum=1)
    shift: Optional[float] = setting(None, "sigma shift")
    modules: Tuple[str, ...] = setting((), "targets", choices=["a", "b"])
    config: str = setting(None, "a file", required=True, flag="--the-config")
    verbose: bool = setting(False, "talk")
    caller_only: int = 0  # no flag


def _parse(argv):
    return add_setting_args(argparse.ArgumentParser(), Example).parse_args(argv)


def test_fields_become_flags_with_their_type_default_and_choices():
    args = _parse(["--the-config", "c.json", "--modules", "b", "a", "--shift", "3", "--verbose"])
    assert from_args(Example, args, caller_only=5) == Example(16, 3.0, ("b", "a"), "c.json", True, 5)
    assert not hasattr(args, "caller_only")
    with pytest.raises(SystemExit):
        _parse([])  # --the-config is required
    with pytest.raises(SystemExit):
        _parse(["--the-config", "c", "--modules", "z"])  # not a choice


def test_minimum_is_one_line_naming_the_flag_and_none_passes():
    check_bounds(_parse(["--the-config", "c"]), Example)
    with pytest.raises(ValueError, match=r"^--steps must be >= 1, got 0$"):
        check_bounds(_parse(["--the-config", "c", "--steps", "0"]), Example)


@dataclasses.dataclass(frozen=True)
class Rates:
    lr: float = setting(1e-5, "a rate", above=0)
    decay: float = setting(0.0, "a decay", minimum=0, below=1)


@pytest.mark.parametrize("argv, line", [
    (["--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),  # NaN fails every bound
    (["--decay", "1"], "--decay must be < 1, got 1.0"),
    (["--decay", "-0.5"], "--decay must be >= 0, got -0.5"),
])
def test_strict_bounds_are_one_line_naming_the_flag(argv, line):
    parser = accept_negative_numbers(add_setting_args(argparse.ArgumentParser(), Rates))
    with pytest.raises(ValueError) as refused:
        check_bounds(parser.parse_args(argv), Rates)
    assert str(refused.value) == line
    check_bounds(parser.parse_args(["--lr", "1e-9", "--decay", "0"]), Rates)
    with pytest.raises(ValueError, match=r"^--lr must be > 0, got -1.0$"):
        from_args(Rates, parser.parse_args(["--lr", "-1"]))


@pytest.mark.parametrize("value, number", [("-1e-4", -1e-4), ("-1E+3", -1e3), ("-.5", -0.5), ("-2.", -2.0)])
def test_a_negative_number_with_an_exponent_reaches_its_flag(value, number, capsys):
    """argparse alone reads "-1e-4" as an option (its negative-number pattern has no exponent)."""
    with pytest.raises(SystemExit):
        add_setting_args(argparse.ArgumentParser(), Rates).parse_args(["--lr", "-1e-4"])
    assert "expected one argument" in capsys.readouterr().err
    parser = accept_negative_numbers(add_setting_args(argparse.ArgumentParser(), Rates))
    assert parser.parse_args(["--lr", value]).lr == number
    with pytest.raises(SystemExit):  # an option is still an option
        parser.parse_args(["--lr", "-e4"])


def test_an_unknown_key_is_one_line_with_the_nearest_known_one():
    known = ("from_pretrained", "max_sequence_length")
    check_keys({"from_pretrained": "x"}, known, "model.json text_encoder")
    with pytest.raises(ValueError) as refused:
        check_keys({"max_seq_length": 16}, known, "model.json text_encoder")
    assert str(refused.value) == 'model.json text_encoder: unknown key "max_seq_length" (did you mean ' \
                                 '"max_sequence_length"?)'
    with pytest.raises(ValueError) as refused:
        check_keys({"zzz": 1}, known, "model.json text_encoder")
    assert str(refused.value) == 'model.json text_encoder: unknown key "zzz" (known: from_pretrained, ' \
                                 'max_sequence_length)'
    with pytest.raises(ValueError, match=r"^model.json ae must be a JSON object, got list$"):
        check_keys(["from_pretrained"], known, "model.json ae")


@dataclasses.dataclass(frozen=True)
class Block:
    steps: Count = 16
    shift: Optional[float] = None
    kind: Literal["ode", "sde"] = "ode"
    fast: bool = False


@pytest.mark.parametrize("block, line", [
    ({"steps": "16"}, "steps must be a whole number >= 1, got '16'"),
    ({"steps": True}, "steps must be a whole number >= 1, got True"),
    ({"steps": 1.0}, "steps must be a whole number >= 1, got 1.0"),
    ({"steps": 0}, "steps must be a whole number >= 1, got 0"),
    ({"shift": "3"}, "shift must be a number, got '3'"),
    ({"kind": "od"}, "kind must be one of \"ode\", \"sde\", got 'od' (did you mean \"ode\"?)"),
    ({"fast": "false"}, "fast must be true or false, got 'false'"),
    ({"fast": 1}, "fast must be true or false, got 1"),
    ({"stesp": 1}, 'unknown key "stesp" (did you mean "steps"?)'),
])
def test_a_block_value_of_the_wrong_type_is_one_line(block, line):
    with pytest.raises(ValueError) as refused:
        read_block(Block, block, "model.json x")
    assert str(refused.value) == f"model.json x: {line}"


def test_a_whole_variable_is_read_as_the_number_or_boolean_the_field_wants(monkeypatch):
    monkeypatch.setenv("STEPS", "8")
    monkeypatch.setenv("FAST", "true")
    monkeypatch.setenv("KIND", "sde")
    assert read_block(Block, {"steps": "$STEPS", "shift": "${STEPS}", "kind": "$KIND", "fast": "$FAST"}, "b") == \
        Block(8, 8.0, "sde", True)
    with pytest.raises(ValueError) as refused:  # part of a text is text
        read_block(Block, {"steps": "$STEPS$STEPS"}, "b")
    assert str(refused.value) == "b: steps must be a whole number >= 1, got '88' (from $STEPS$STEPS)"
    monkeypatch.delenv("STEPS")
    with pytest.raises(ValueError) as refused:
        read_block(Block, {"steps": "$STEPS"}, "b")
    assert str(refused.value) == "b: steps uses $STEPS, which is not set in the environment"


def test_expansion_names_the_entry_and_leaves_comments_and_keeps_what_was_written(monkeypatch):
    monkeypatch.delenv("NOT_SET", raising=False)
    monkeypatch.setenv("DIR", "/models")
    config = {"comment": "$NOT_SET", "reward": [{"name": "hps", "path": "$DIR/hps.pt"}]}
    expanded = expand_variables(config, "model.json")
    assert expanded == {"comment": "$NOT_SET", "reward": [{"name": "hps", "path": "/models/hps.pt"}]}
    path = expanded["reward"][0]["path"]
    assert pickle.loads(pickle.dumps(path)).written == path.written == "$DIR/hps.pt"
    with pytest.raises(ValueError) as refused:
        expand_variables({"reward": [{"name": "hps", "path": "$NOT_SET"}]}, "model.json")
    assert str(refused.value) == 'model.json reward "hps": path uses $NOT_SET, which is not set in the environment'
    assert isinstance(expand_variables("${DIR}", "x"), Expanded)


def test_a_bool_on_by_default_is_switched_off_by_its_no_flag():
    @dataclasses.dataclass
    class On:
        fast: bool = setting(True, "on unless told")
    parser = add_setting_args(argparse.ArgumentParser(), On)
    assert parser.parse_args([]).fast and not parser.parse_args(["--no-fast"]).fast


def test_a_separated_tuple_keeps_items_that_hold_spaces():
    @dataclasses.dataclass
    class Listed:
        relations: Tuple[str, ...] = setting(("above",), "comma-separated", sep=",")
        weights: Tuple[float, ...] = setting((1.0,), "comma-separated", sep=",")
    parser = add_setting_args(argparse.ArgumentParser(), Listed)
    args = parser.parse_args(["--relations", "left of, above", "--weights", "1,2.5"])
    assert from_args(Listed, args) == Listed(("left of", "above"), (1.0, 2.5))
    with pytest.raises(SystemExit):
        parser.parse_args(["--weights", "1,x"])


def test_every_training_flag_is_declared_once_as_a_setting():
    """The trainers' parsers hold only `setting` fields' flags, none declared twice."""
    classes = [cls for groups in (arguments.MEGATRON_GROUPS, arguments.GRPO_GROUP) for classes in groups.values()
               for cls in classes]
    fields = [f.name for cls in classes for f in dataclasses.fields(cls) if "help" in f.metadata]
    assert len(fields) == len(set(fields))
    parser = arguments.build_parser()
    assert sorted(a.dest for a in parser._actions if a.option_strings and a.dest != "help") == sorted(fields)


@pytest.mark.parametrize("flag, value", [("--tensor-model-parallel-size", "0"), ("--distributed-timeout-minutes", "0"),
                                         ("--save-interval", "-1"), ("--eval-prompts", "0")])
def test_training_counts_below_their_minimum_are_refused_before_any_file_is_read(flag, value):
    with pytest.raises(ValueError, match=f"^{flag} must be >= "):
        arguments.parse_args(["--train-iters", "1", "--mm-model", "/missing", "--mm-data", "/missing", flag, value])
