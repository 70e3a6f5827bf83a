"""Settings declared once (mm_grpo/settings.py): the flag, its parsing and its checks come from the field."""
import argparse
import dataclasses
from typing import Optional, Tuple

import pytest

from mm_grpo.settings import add_setting_args, check_minimums, from_args, setting
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
    check_minimums(_parse(["--the-config", "c"]), Example)
    with pytest.raises(ValueError, match=r"^--steps must be >= 1, got 0$"):
        check_minimums(_parse(["--the-config", "c", "--steps", "0"]), Example)


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
