"""The Megatron Qwen-Image model against diffusers' QwenImageTransformer2DModel (fp32, CPU, one
process): outputs and every parameter's gradient to 1e-5 with prompts of mixed lengths masked, on
square and non-square grids; the padded text changes nothing; weights and configs refused in one line.
Every parallel layout against this one process: tests/distributed/checks_qwen_image.py."""
import json

import pytest
import torch

from mm_grpo.families.qwen_image.transformer import QwenImageConfig, QwenImageTransformer
from mm_grpo.families.qwen_image.transformer.hf_weights import load_hf_weights
from mm_grpo.recompute import EVERY_BLOCK, Recompute, recompute_fields
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.qwen_image_utils import TINY, hf_grads_as_megatron, make_inputs, random_reference, reference_output
from tests.utils import assert_one_line_error, count_block_forwards, rel_err

TOL = 1e-5
# Another shape of head: 2 heads of 24 channels, rope axes (4, 10, 10), 3 blocks.
NARROW = TINY.replace(num_attention_heads=2, attention_head_dim=24, axes_dims_rope=(4, 10, 10), num_layers=3)


def _model(config, ref):
    return load_hf_weights(QwenImageTransformer(config), ref.state_dict())


@pytest.mark.parametrize("config", [TINY, NARROW], ids=["tiny", "narrow"])
@pytest.mark.parametrize("lengths,height,width", [
    ((5,), 4, 4), ((7, 3), 3, 5), ((1, 9, 4), 2, 7), ((6, 6), 6, 2)], ids=["one", "mixed", "three", "whole"])
def test_forward_matches_diffusers(parallel_1proc, config, lengths, height, width):
    ref = random_reference(config, seed=sum(lengths))
    model = _model(config, ref)
    inputs = make_inputs(config, lengths, height, width, seed=height)
    with torch.no_grad():
        expected = reference_output(ref, inputs)
        out = model(**inputs)
    assert out.shape == expected.shape == (len(lengths), height * width, config.output_channels)
    assert rel_err(out, expected) <= TOL


def test_every_gradient_matches_diffusers_with_masked_text(parallel_1proc):
    ref = random_reference(TINY, seed=11)
    model = _model(TINY, ref)
    inputs = make_inputs(TINY, lengths=(6, 2), height=3, width=4)
    weight = torch.randn(2, 12, TINY.output_channels)
    (reference_output(ref, inputs) * weight).sum().backward()
    (model(**inputs) * weight).sum().backward()
    expected = hf_grads_as_megatron(ref, TINY)
    params = dict(model.named_parameters())
    assert set(params) == set(expected)
    # the last block's text projection and MLP feed nothing: no gradient, on both sides
    unused = {n for n, g in expected.items() if g is None}
    assert unused == {n for n, p in params.items() if p.grad is None} == {
        f"blocks.1.txt_{m}.{w}" for m in ("attn.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2") for w in ("weight", "bias")}
    errs = {n: rel_err(params[n].grad, g) for n, g in expected.items() if n not in unused}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, worst


def test_the_padding_of_a_short_prompt_changes_nothing(parallel_1proc):
    """A prompt's output is the same alone and batched with a longer one (padded, masked), whatever the
    padding holds."""
    model = _model(TINY, random_reference(TINY, seed=3))
    batched = make_inputs(TINY, lengths=(2, 7), height=3, width=3)
    batched["encoder_hidden_states"][0, 2:] = 1e3  # the short prompt's padding
    alone = {k: (v[:1, :2] if k == "encoder_hidden_states" else v[:1]) for k, v in batched.items()
             if k not in ("encoder_hidden_states_mask", "img_shapes")}
    with torch.no_grad():
        out = model(**batched)
        short = model(**alone, encoder_hidden_states_mask=None, img_shapes=[[(1, 3, 3)]])
    # not bit-equal: the text positions shift nothing, but attention sums over another number of keys
    assert rel_err(out[:1], short) <= TOL
    # the rotary tables of the last call only are kept: prompts of other lengths do not pile up tables
    assert model._rope_cache[0] == (((1, 3, 3),), 2, torch.device("cpu"))


@pytest.mark.parametrize("recompute", [EVERY_BLOCK, Recompute("uniform", 2), Recompute("block", 1)],
                         ids=["uniform1", "uniform2", "block1"])
def test_recompute_gives_identical_gradients_and_reruns_the_blocks_megatron_names(parallel_1proc, recompute):
    """Megatron's full recompute (tests/test_flux_model.py's test, on Qwen-Image's blocks)."""
    ref = random_reference(TINY, seed=2)
    inputs = make_inputs(TINY)
    runs = []
    for config in (TINY, TINY.replace(**recompute_fields(recompute))):
        model = _model(config, ref)
        calls = count_block_forwards(model.blocks)
        loss = model(**inputs).square().sum()
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                     list(calls)))
    (plain_loss, plain, plain_calls), (loss, grads, calls) = runs
    assert torch.equal(plain_loss, loss) and plain.keys() == grads.keys()
    for name, g in plain.items():
        assert torch.equal(g, grads[name]), name
    n = TINY.num_layers
    assert n >= 2 and plain_calls == [1] * n
    assert calls == ([2] * n if recompute.method == "uniform" else [2] + [1] * (n - 1))


def test_bf16_stays_close_and_rope_stays_fp32(parallel_1proc):
    ref = random_reference(TINY, seed=4)
    inputs = make_inputs(TINY)
    fp32, bf16 = _model(TINY, ref), _model(TINY.replace(bf16=True), ref)
    with torch.no_grad():
        expected, out = fp32(**inputs), bf16(**inputs)
    assert out.dtype == torch.bfloat16 and 0 < rel_err(out.float(), expected) < 5e-2
    assert all(t.dtype == torch.float32 for t in bf16.rope(((1, 4, 6),), 7, torch.device("cpu")))


def test_the_presets_are_diffusers_models():
    """The 20B preset is diffusers' default QwenImageTransformer2DModel (Qwen/Qwen-Image's config)."""
    from diffusers import QwenImageTransformer2DModel
    with torch.device("meta"):
        ref = QwenImageTransformer2DModel()
    config = QwenImageConfig.preset("qwen-image")
    assert {k: ref.config[k] for k in config.to_diffusers_config()} == {
        **config.to_diffusers_config(), "axes_dims_rope": tuple(config.axes_dims_rope)}
    assert config.hidden_size == 3072 and config.num_layers == 60
    # 20.4B parameters, as Qwen-Image's
    assert 20.3e9 < sum(p.numel() for p in ref.parameters()) < 20.5e9


def _write_folder(tmp_path, ref, **config_changes):
    folder = tmp_path / "transformer"
    ref.save_pretrained(folder, max_shard_size="40KB")  # sharded with an index, as the real one
    if config_changes:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **config_changes}))
    return folder


def test_a_sharded_diffusers_folder_and_a_pipeline_folder_load(parallel_1proc, tmp_path):
    ref = random_reference(TINY, seed=5)
    folder = _write_folder(tmp_path, ref)
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert QwenImageConfig.from_diffusers_config(tmp_path) == TINY  # the pipeline folder above it
    inputs = make_inputs(TINY)
    with torch.no_grad():
        expected = reference_output(ref, inputs)
        for path in (folder, tmp_path):
            assert rel_err(load_hf_weights(QwenImageTransformer(TINY), str(path))(**inputs), expected) <= TOL


def test_bad_configs_and_weights_are_one_line(parallel_1proc, tmp_path):
    ref = random_reference(TINY, seed=6)
    folder = _write_folder(tmp_path, ref, zero_cond_t=True)
    assert_one_line_error(lambda: QwenImageConfig.from_diffusers_config(folder),
                          r"config\.json: zero_cond_t: True is a Qwen-Image variant this transformer does not build")
    (folder / "config.json").write_text(json.dumps({**TINY.to_diffusers_config(), "num_attention_heads": "four"}))
    assert_one_line_error(lambda: QwenImageConfig.from_diffusers_config(folder),
                          r"config\.json: num_attention_heads must be")
    assert_one_line_error(lambda: QwenImageConfig.from_diffusers_config({"num_layer": 2}),
                          r"unknown Qwen-Image config field\(s\) \['num_layer'\]")
    assert_one_line_error(lambda: QwenImageConfig.preset("qwen"), "unknown Qwen-Image preset 'qwen'")
    state = ref.state_dict()
    del state["txt_norm.weight"]
    state["transformer_blocks.0.attn.to_k.weight"] = torch.zeros(3, 3)
    assert_one_line_error(lambda: load_hf_weights(QwenImageTransformer(TINY), state), "missing weights: txt_norm.weight")
    assert_one_line_error(lambda: load_hf_weights(QwenImageTransformer(TINY), str(tmp_path / "nope")),
                          "no such Qwen-Image checkpoint", FileNotFoundError)
    model = QwenImageTransformer(TINY)
    inputs = make_inputs(TINY, lengths=(3, 3))
    assert_one_line_error(lambda: model(**{**inputs, "img_shapes": [[(1, 4, 6)], [(1, 6, 4)]]}),
                          r"img_shapes differ within the batch")
    assert_one_line_error(lambda: model(**{**inputs, "img_shapes": [[(1, 4, 4)]] * 2}),
                          r"img_shapes \[\(1, 4, 4\)\] make 16 image tokens, but hidden_states has 24")
    assert_one_line_error(lambda: QwenImageTransformer(TINY.replace(num_attention_heads=3, attention_head_dim=16,
                                                                    axes_dims_rope=(16, 16, 16))),
                          r"axes_dims_rope")


def _true_cfg_reference(ref, x, sigma, pos, neg, scale):
    """QwenImagePipeline's step velocity, transcribed in float64: two calls (each prompt at its own
    length and mask), then comb = u + s (c - u) rescaled to |c| over the channels."""
    c = reference_output(ref, dict(hidden_states=x, timestep=sigma, img_shapes=[[(1, 3, 4)]] * len(x), **pos)).double()
    u = reference_output(ref, dict(hidden_states=x, timestep=sigma, img_shapes=[[(1, 3, 4)]] * len(x), **neg)).double()
    comb = u + scale * (c - u)
    return comb * (torch.norm(c, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_the_denoisers_velocity_is_the_pipelines_true_cfg_step(parallel_1proc, scale):
    """The rollout's velocity (micro-batches of 2, true CFG in one call of 4 with the 5-token negative
    prompt padded to the 7-token prompts) and the training forward against QwenImagePipeline's two
    calls and rescale; scale 1 is the conditional call alone."""
    from mm_grpo.families.qwen_image.denoiser import QwenImageDenoiser
    ref = random_reference(TINY, seed=8)
    model = _model(TINY, ref)
    inputs = make_inputs(TINY, lengths=(7, 3, 5, 7), height=3, width=4, seed=3)
    g = torch.Generator().manual_seed(4)
    negative = (torch.randn(1, 5, TINY.joint_attention_dim, generator=g), torch.ones(1, 5, dtype=torch.long))
    denoiser = QwenImageDenoiser(48, 64, TINY.in_channels, scale, negative if scale > 1 else None)
    text = (inputs["encoder_hidden_states"], inputs["encoder_hidden_states_mask"])
    cond = denoiser.conditioning(text, None, torch.device("cpu"))
    x, sigma = inputs["hidden_states"], inputs["timestep"]
    pos = {"encoder_hidden_states": text[0], "encoder_hidden_states_mask": text[1]}
    neg = {"encoder_hidden_states": negative[0].expand(4, -1, -1), "encoder_hidden_states_mask": negative[1].expand(4, -1)}
    with torch.no_grad():
        expected = (_true_cfg_reference(ref, x, sigma, pos, neg, scale) if scale > 1
                    else reference_output(ref, dict(hidden_states=x, timestep=sigma, img_shapes=[[(1, 3, 4)]] * 4, **pos)))
        v = denoiser.velocity_fn([model], cond, micro_batch_size=2)(x, sigma)
        trained = denoiser.forward(model, dict(denoiser.rows_of(cond, torch.tensor([1, 2])), hidden_states=x[1:3],
                                               timestep=sigma[1:3]))
    assert denoiser.latent_shape == (12, TINY.in_channels) and v.shape == x.shape[:2] + (TINY.output_channels,)
    assert rel_err(v, expected) <= TOL
    assert rel_err(trained, expected[1:3]) <= TOL
