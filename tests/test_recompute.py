"""Megatron's full recompute flags in the trainers (`--recompute-granularity full --recompute-method
uniform|block --recompute-num-layers N`, mm_grpo/recompute.py).

- Which blocks each method recomputes, against Megatron's own loop (`TransformerBlock._checkpointed_forward`
  of the testbed's Megatron-LM, read here as text: its uniform `while` over groups, its block `if` on the
  first N), and every wrong combination refused in one line naming the flag, before any file is read.
- A GRPO run with the first two blocks recomputed trains bit for bit what the plain run trains (losses,
  gradient norms, weights), saved at 1 and resumed repeats it; the trainer's model gets the method.
- Inside MindSpeed-MM's `pretrain` the FLUX and Qwen-Image predictors read Megatron's parsed arguments,
  as MindSpeed-MM's own DiTs do, over model.json's older `recompute_blocks`.
The models' gradients and recomputed blocks per method: tests/test_flux_model.py, tests/test_qwen_image_model.py.
"""
import argparse
import os
import re

import pytest
import torch

from mm_grpo.recompute import EVERY_BLOCK, Recompute, recompute_fields, recompute_flags
from mm_grpo.training.arguments import parse_args
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import grpo_argv, run_grpo, write_configs
from tests.testbed import TESTBED, has_megatron_training
from tests.utils import assert_one_line_error

MEGATRON_BLOCK = os.path.join(TESTBED, "Megatron-LM", "megatron", "core", "transformer", "transformer_block.py")


def test_the_spans_are_megatrons_loop():
    """Megatron's uniform method steps `layer_idx += recompute_num_layers` and checkpoints
    `custom(layer_idx, layer_idx + recompute_num_layers)` (a slice: the last group may be short); its block
    method checkpoints `custom(layer_idx, layer_idx + 1)` while `layer_idx < recompute_num_layers`."""
    with open(MEGATRON_BLOCK) as f:
        source = f.read()
    assert re.search(r"custom\(layer_idx, layer_idx \+ self\.config\.recompute_num_layers\)", source)
    assert "layer_idx += self.config.recompute_num_layers" in source
    assert re.search(r"layer_idx < self\.config\.recompute_num_layers \+ recompute_skip_num_layers", source)

    def megatron(method, n, count):  # those loops, per block: the group it is checkpointed in, or None
        if method == "uniform":
            return [(i // n * n, min(i // n * n + n, count)) for i in range(count)]
        return [(i, i + 1) if i < n else None for i in range(count)]

    for method in ("uniform", "block"):
        for n in (1, 2, 3, 7):
            for count in (1, 5, 6):
                spans = Recompute(method, n).spans(count)
                assert [s for s, e, _ in spans] == sorted({s for s, _, _ in spans}) and spans[-1][1] == count
                ours = [(s, e) if again else None for s, e, again in spans for _ in range(e - s)]
                assert ours == megatron(method, n, count), (method, n, count)


ARGV = ["--mm-model", "no_such_model.json", "--mm-data", "no_such_data.json", "--train-iters", "1"]


@pytest.mark.parametrize("flags,match", [
    (["--recompute-activations"], r"^--recompute-activations \(Megatron's selective recompute\): recomputing core "
                                  r"attention only is not implemented .* --recompute-granularity full --recompute-method"),
    (["--recompute-granularity", "selective"], r"^--recompute-granularity selective: recomputing core attention"),
    (["--recompute-granularity", "full"], r"^--recompute-granularity full needs --recompute-method \(uniform or block\)"),
    (["--recompute-granularity", "full", "--recompute-method", "block"],
     r"^--recompute-granularity full needs --recompute-num-layers"),
    (["--recompute-method", "block", "--recompute-num-layers", "2"],
     r"^--recompute-method and --recompute-num-layers given without --recompute-granularity full"),
])
def test_each_wrong_combination_is_one_line_before_any_file_is_read(flags, match):
    assert_one_line_error(lambda: parse_args(ARGV + flags), match)


@pytest.mark.parametrize("flags", [["--recompute-method", "blocks"], ["--recompute-granularity", "ful"]])
def test_a_value_not_a_choice_is_one_line_naming_the_flag(flags, capsys):
    with pytest.raises(SystemExit):
        parse_args(ARGV + flags)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flags[0] in err, err


def test_a_count_below_one_is_one_line():
    assert_one_line_error(lambda: parse_args(ARGV + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                                     "--recompute-num-layers", "0"]),
                          r"^--recompute-num-layers must be >= 1, got 0$")


@pytest.fixture(scope="module")
def configs(tiny_pipeline_dir, tmp_path_factory):
    return write_configs(tmp_path_factory.mktemp("recompute_cfg"), tiny_pipeline_dir)


def _weights(run):
    return {n: p.detach().clone() for n, p in run.model.modules[0].named_parameters()}


def test_recomputing_the_first_blocks_trains_what_the_plain_run_trains_and_resumes(parallel_1proc, configs, tmp_path):
    flags = recompute_flags(Recompute("block", 2))
    plain, run_plain = run_grpo(grpo_argv(*configs, iters=2))
    full, run_full = run_grpo(grpo_argv(*configs, iters=2, extra=flags))
    assert run_full.model.modules[0].flux_config.recompute == Recompute("block", 2)
    assert run_plain.model.modules[0].flux_config.recompute is None
    for key in ("loss", "grad_norm", "reward/mean"):
        assert [h[key] for h in full] == [h[key] for h in plain], key
    assert min(h["grad_norm"] for h in full) > 0
    a, b = _weights(run_plain), _weights(run_full)
    assert all(torch.equal(a[n], b[n]) for n in a)
    first, _ = run_grpo(grpo_argv(*configs, iters=1, extra=flags + ["--save", str(tmp_path / "ckpt")]))
    second, run_resumed = run_grpo(grpo_argv(*configs, iters=2, extra=flags + ["--load", str(tmp_path / "ckpt")]))
    assert [h["loss"] for h in first + second] == [h["loss"] for h in full]
    c = _weights(run_resumed)
    assert all(torch.equal(b[n], c[n]) for n in b)


@pytest.mark.skipif(not has_megatron_training(), reason="Megatron-LM's parsed arguments: MindSpeed-MM's environment")
@pytest.mark.parametrize("family", ["flux", "qwen_image"])
def test_mindspeed_mm_predictors_read_megatrons_arguments_over_recompute_blocks(parallel_1proc, monkeypatch, family,
                                                                              tiny_pipeline_dir,
                                                                              tiny_qwen_image_pipeline_dir):
    import megatron.training
    if family == "flux":
        from mm_grpo.families.flux.mindspeed_mm import FluxPredictor as Predictor
        from mm_grpo.families.flux.transformer import FluxConfig as Config
        folder = tiny_pipeline_dir
    else:
        from mm_grpo.families.qwen_image.mindspeed_mm import QwenImagePredictor as Predictor
        from mm_grpo.families.qwen_image.transformer import QwenImageConfig as Config
        folder = tiny_qwen_image_pipeline_dir
    transformer = os.path.join(str(folder), "transformer")
    block = {**Config.from_diffusers_config(transformer).to_diffusers_config(), "recompute_blocks": True,
             "from_pretrained": os.path.join(transformer, "diffusion_pytorch_model.safetensors")}

    def built(granularity=None, method=None, num_layers=None):
        # What pretrain's parsed arguments hold (the predictors call megatron.training.get_args, as
        # MindSpeed-MM's DiTs do); Megatron's own global arguments stay as they are for MindSpeed's patches.
        parsed = argparse.Namespace(recompute_granularity=granularity, recompute_method=method,
                                    recompute_num_layers=num_layers)
        monkeypatch.setattr(megatron.training, "get_args", lambda: parsed)
        return Predictor(**block)

    config = lambda model: getattr(model, "flux_config", None) or model.qwen_config  # noqa: E731
    assert config(built()).recompute == EVERY_BLOCK  # no flags: model.json's recompute_blocks
    assert config(built("full", "block", 1)).recompute == Recompute("block", 1)
    assert_one_line_error(lambda: built("selective"), r"^--recompute-granularity selective: recomputing core attention")
    assert recompute_fields(None) == {"recompute_method": None, "recompute_num_layers": None}
