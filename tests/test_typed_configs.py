"""Typed configs: every value mm-grpo reads of model.json, data.json and a diffusers config.json is
checked for its type, its range and its names (model_id, booleans as booleans) before any work, each
wrong one in one line naming the file, the block, the key, what it may hold and the value. A $VARIABLE
is expanded from the environment (a whole one read as the number where one is wanted); a "comment"
is never expanded."""
import json
import os

import pytest

from mm_grpo.grpo.hyperparameters import GRPOSettings
from mm_grpo.settings import Expanded
from mm_grpo.training import components, train_grpo
from mm_grpo.training.arguments import parse_args
from mm_grpo.training.evaluation import eval_settings
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.test_config_keys import (DEMO_DATA, DEMO_MODEL, EXAMPLES, SHIPPED_ENVIRONMENT, _demo_with, _load,
                                    _refused_line, shipped_environment)  # noqa: F401
from tests.test_convert_cli import TINY, assert_refused, diffusers_folder, hf_to_mm, state_dict  # noqa: F401

SIZE = "[height, width]: two whole numbers of pixels from 1 to 4096"


def _refused_demo(tmp_path, capsys, model=DEMO_MODEL, data=DEMO_DATA):
    """The one line the trainer's entry exits 2 with on the CPU demo's configs (or `model`, `data`);
    --save is left unwritten."""
    save = tmp_path / "ckpt"
    line = _refused_line(capsys, ["--mm-model", str(model), "--mm-data", str(data), "--train-iters", "1",
                                  "--save", str(save)])
    assert not save.exists()
    return line


def _set(block, **values):
    return lambda config: (config if block is None else config[block]).update(values)


@pytest.mark.parametrize("edit, where, line", [
    # trained FLUX and exited 0
    (_set("predictor", model_id="fluxx"), "predictor",
     "model_id must be one of \"flux\", \"mmgrpo_qwenimage\", \"wandit\", got 'fluxx' (did you mean \"flux\"?)"),
    (_set("text_encoder", model_id="flux_text_encoder"), "text_encoder",
     "model_id must be \"flux_text_encoders\", got 'flux_text_encoder' (did you mean \"flux_text_encoders\"?)"),
    (_set("ae", model_id="wan_video_vae"), "ae",  # Wan's VAE under a FLUX predictor
     "model_id must be one of \"autoencoder_kl\", \"flux_vae\", got 'wan_video_vae'"),
    # 22-29 line tracebacks
    (_set(None, image_size="64x64"), "", f"image_size must be {SIZE}, got '64x64'"),
    (_set(None, image_size=[64]), "", f"image_size must be {SIZE}, got [64]"),
    (_set("text_encoder", max_sequence_length="16"), "text_encoder",
     "max_sequence_length must be a whole number >= 1 and <= 512, got '16'"),
    (lambda c: c["reward"][0].update(weight="1"), 'reward "compositional_accuracy"',
     "weight must be a number, got '1'"),
    (_set("predictor", guidance_embeds="yes"), "predictor", "guidance_embeds must be true or false, got 'yes'"),
    # failed 44 lines deep allocating 80 GB
    (_set(None, image_size=[100000, 100000]), "", f"image_size must be {SIZE}, got [100000, 100000]"),
], ids=["model_id", "text_encoder_model_id", "ae_model_id", "size_text", "size_one", "sequence_text",
        "weight_text", "bool_text", "size_huge"])
def test_a_wrong_model_json_value_stops_the_demo_in_one_line(tmp_path, capsys, edit, where, line):
    model = _demo_with(tmp_path, edit)
    block = f"{model} {where}" if where else model
    assert _refused_demo(tmp_path, capsys, model=model) == f"mm-grpo: error: {block}: {line}"


def _data_with(tmp_path, edit):
    config = _load(DEMO_DATA)
    edit(config)
    path = tmp_path / "data.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("edit, line", [
    (_set("dataloader_param", shuffle="yes"), "dataloader_param: shuffle must be true or false, got 'yes'"),
    (_set("dataloader_param", shuffle="false"), "dataloader_param: shuffle must be true or false, got 'false'"),
    (_set("dataloader_param", seed="x"),
     "dataloader_param: seed must be a whole number >= 0 and <= 9223372036854775807, got 'x'"),
    (_set("dataset_param", eval_samples_per_prompt="16"),  # written as text: not a number
     "dataset_param: eval_samples_per_prompt must be a whole number >= 1, got '16'"),
], ids=["shuffle_yes", "shuffle_false", "seed", "samples_text"])
def test_a_wrong_data_json_value_stops_the_demo_in_one_line(tmp_path, capsys, edit, line):
    data = _data_with(tmp_path, edit)
    assert _refused_demo(tmp_path, capsys, data=data) == f"mm-grpo: error: {data} {line}"


def test_a_variable_that_is_no_number_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EVAL_SAMPLES", "sixty-four")
    assert _refused_demo(tmp_path, capsys) == (
        f"mm-grpo: error: {DEMO_DATA} dataset_param: eval_samples_per_prompt must be a whole number >= 1, got "
        "'sixty-four' (from $EVAL_SAMPLES)")


def test_whole_variables_are_read_as_the_numbers_and_booleans_they_hold(tmp_path, monkeypatch):
    """grpo_flux.sh's EVAL_SAMPLES / EVAL_SEED, and a SHUFFLE=false, arrive as text."""
    data = _data_with(tmp_path, _set("dataloader_param", shuffle="$SHUFFLE", seed="${DATA_SEED}"))
    monkeypatch.setenv("SHUFFLE", "false")
    monkeypatch.setenv("DATA_SEED", "7")
    config = _load(data)
    components.check_data_config(config, str(data))
    resolved = components.resolve_paths(config, str(tmp_path))
    assert eval_settings(resolved["dataset_param"]) == (64, 1)
    train, _ = components.prompt_streams(resolved, str(data), seed=0)
    assert (train.shuffle, train.seed) == (False, 7)


def test_a_literal_number_in_text_is_refused_where_a_variable_is_read():
    with pytest.raises(ValueError) as refused:
        eval_settings({"eval_samples_per_prompt": "64"})
    assert str(refused.value) == ("--mm-data dataset_param: eval_samples_per_prompt must be a whole number >= 1, "
                                  "got '64'")
    assert eval_settings({"eval_samples_per_prompt": Expanded("64", "$EVAL_SAMPLES")}) == (64, 0)


def test_an_unset_variable_is_named_not_the_comment(tmp_path, capsys, monkeypatch):
    """The shipped model.json with PIPELINE_DIR set and HPS_PATH not: the error quoted the comment (whose
    text names both) instead of the variable missing."""
    monkeypatch.delenv("HPS_PATH")
    model = os.path.join(EXAMPLES, "flux", "model.json")
    assert _refused_demo(tmp_path, capsys, model=model) == (
        f'mm-grpo: error: {model} reward "hps": path uses $HPS_PATH, which is not set in the environment')


def test_comments_stay_as_written(monkeypatch):
    monkeypatch.delenv("PIPELINE_DIR")
    config = {"comment": "$PIPELINE_DIR is a pipeline folder", "image_size": [64, 64]}
    assert components.resolve_paths(config, "/configs") == config
    monkeypatch.setenv("PIPELINE_DIR", "/models/flux")
    config = {"comment": "$PIPELINE_DIR", "ae": {"from_pretrained": "$PIPELINE_DIR/vae"}}
    assert components.resolve_paths(config, "/configs") == {"comment": "$PIPELINE_DIR",
                                                           "ae": {"from_pretrained": "/models/flux/vae"}}


def test_wan_blocks_take_wans_names_and_types():
    model = json.loads(json.dumps(_load(os.path.join(EXAMPLES, "wan", "model_tiny.json"))))
    model["ae"]["model_id"] = "wan_video_vae"  # MindSpeed-MM's name for Wan's VAE
    model["text_encoder"]["model_id"] = "UMT5"
    components.check_model_config(model, "model.json")
    for block, key, value, line in (
            ("ae", "model_id", "autoencoder_kl", "ae: model_id must be \"wan_video_vae\", got 'autoencoder_kl'"),
            ("predictor", "in_dim", "4", "predictor: in_dim must be a whole number >= 1, got '4'"),
            (None, "num_frames", "5", ": num_frames must be a whole number >= 1, got '5'")):
        changed = json.loads(json.dumps(model))
        (changed if block is None else changed[block])[key] = value
        with pytest.raises(ValueError) as refused:
            components.check_model_config(changed, "model.json")
        assert str(refused.value) == f"model.json{'' if block is None else ' '}{line}"


def test_wans_rope_table_bounds_the_frames():
    from mm_grpo.families.wan.mindspeed_mm import video_size
    model = _load(os.path.join(EXAMPLES, "wan", "model_tiny.json"))
    assert video_size(dict(model, num_frames=253)) == (253, 32, 32)  # 64 latent frames: max_seq_len 64
    with pytest.raises(ValueError) as refused:
        video_size(dict(model, num_frames=257))
    assert str(refused.value) == ("257 frames at 32x32: 65 x 2 x 2 tokens (frames x rows x columns), more along an "
                                  "axis than the predictor's max_seq_len 64, the positions of wandit's RoPE table")


def test_a_flag_beyond_the_largest_side_is_one_line():
    with pytest.raises(ValueError) as refused:
        components.image_size({}, 100000, 64)
    assert str(refused.value) == "image size 100000x64: at most 4096 pixels a side, 65,536 tokens a sample"


def test_mm_convert_refuses_a_wrong_type_in_config_json(capsys, tmp_path, state_dict):  # noqa: F811
    """`"num_attention_heads": "four"` in config.json was a 39-line traceback."""
    source = diffusers_folder(tmp_path / "src", state_dict)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(dict(config, num_attention_heads="four")))
    code, _, err = hf_to_mm(capsys, source, tmp_path / "dst")
    assert_refused(code, err, "^mm-convert: error: " + str(source / "config.json").replace(".", r"\.") +
                   ": num_attention_heads must be a whole number >= 1, got 'four'\n$", tmp_path, tmp_path / "dst")


# --- a fraction that trains no step -----------------------------------------------------------------
def test_a_fraction_that_selects_no_step_is_refused_by_the_settings():
    with pytest.raises(ValueError) as refused:
        GRPOSettings(num_inference_steps=4, timestep_fraction=0.3).check(1)
    assert str(refused.value) == ("--timestep-fraction 0.3 with --num-inference-steps 4 (--timestep-selection "
                                  "random): timestep fraction 0.3 of 3 steps selects none; use >= 0.3333")


def test_a_fraction_that_selects_no_step_stops_the_run_before_the_model(parallel_1proc, monkeypatch):  # noqa: F811
    """STEPS=4 with such a fraction was refused after the model was built and the first evaluation ran."""
    monkeypatch.setattr(train_grpo, "build_trainable", lambda *a, **k: pytest.fail("the model was built first"))
    args = parse_args(["--mm-model", DEMO_MODEL, "--mm-data", DEMO_DATA, "--train-iters", "1",
                       "--num-inference-steps", "4", "--timestep-fraction", "0.3", "--num-generations", "2"])
    with pytest.raises(ValueError, match=r"^--timestep-fraction 0\.3 with --num-inference-steps 4 "):
        train_grpo.GRPORun(args)


# --- the reward server reads its reward list through the same checks ----------------------------------
@pytest.mark.parametrize("entries, line", [
    ([{"name": "jpeg_compressibility", "weight": "1"}],
     "reward config \"jpeg_compressibility\": weight must be a number, got '1'"),
    ([{"name": "hps", "path": "$HPS_PATH"}], '--rewards {path} "hps": path uses $HPS_PATH, which is not set in the environment'),
], ids=["weight_text", "unset_variable"])
def test_the_reward_server_refuses_a_wrong_value_in_one_line(tmp_path, capsys, monkeypatch, entries, line):
    from mm_grpo.tools.reward_server import PROG, main
    monkeypatch.delenv("HPS_PATH")
    rewards = tmp_path / "rewards.json"
    rewards.write_text(json.dumps(entries))
    with pytest.raises(SystemExit) as exit_:
        main(["--rewards", str(rewards), "--port", "0"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"{PROG}: error: {line.format(path=rewards)}\n"
