"""The Megatron FLUX model against diffusers' FluxTransformer2DModel (fp32, CPU, TP = 1)."""
import json

import pytest
import torch

from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer
from mm_grpo.families.flux.transformer.hf_weights import load_hf_weights
from mm_grpo.families.flux.transformer.model import check_parallel_sizes
from mm_grpo.recompute import EVERY_BLOCK, Recompute, recompute_fields
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.utils import (assert_one_line_error, count_block_forwards, hf_grads_as_megatron, make_inputs, random_reference, reference_output,
                         rel_err)

TOL = 1e-5
TINY = FluxConfig.preset("tiny")
TINY_SCHNELL = TINY.replace(guidance_embeds=False, num_attention_heads=2, attention_head_dim=24,
                            axes_dims_rope=(4, 10, 10), num_single_layers=2)


def _model(config, ref):
    return load_hf_weights(FluxTransformer(config), ref.state_dict())


@pytest.mark.parametrize("config", [TINY, TINY_SCHNELL], ids=["guidance", "no-guidance"])
@pytest.mark.parametrize("batch,height,width,txt_len", [
    (1, 4, 4, 1), (3, 3, 5, 13), (1, 2, 7, 77), (3, 6, 2, 77)])
def test_forward_matches_diffusers(parallel_1proc, config, batch, height, width, txt_len):
    ref = random_reference(config, seed=batch + txt_len)
    model = _model(config, ref)
    inputs = make_inputs(config, batch, height, width, txt_len, seed=height)
    with torch.no_grad():
        expected = reference_output(ref, inputs)
        out = model(**inputs)
    assert out.shape == expected.shape == (batch, height * width, config.output_channels)
    assert rel_err(out, expected) <= TOL


def test_gradients_match_diffusers(parallel_1proc):
    ref = random_reference(TINY, seed=11)
    model = _model(TINY, ref)
    inputs = make_inputs(TINY, batch=2, height=3, width=4, txt_len=5)
    weight = torch.randn(2, 12, TINY.output_channels)
    (reference_output(ref, inputs) * weight).sum().backward()
    (model(**inputs) * weight).sum().backward()
    expected = hf_grads_as_megatron(ref, TINY)
    params = dict(model.named_parameters())
    assert set(params) == set(expected)
    errs = {n: rel_err(params[n].grad, g) for n, g in expected.items()}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, worst


@pytest.mark.parametrize("recompute", [EVERY_BLOCK, Recompute("uniform", 4), Recompute("block", 3)],
                         ids=["uniform1", "uniform4", "block3"])
def test_recompute_gives_identical_gradients_and_reruns_the_blocks_megatron_names(parallel_1proc, recompute):
    """Megatron's full recompute over the 2 double- and 4 single-stream blocks (one chunk): the loss and
    every gradient bit for bit as without it, and the blocks Megatron's method names run their forward
    again in the backward: uniform, all of them (in groups of N); block 3, the first three only."""
    ref = random_reference(TINY, seed=2)
    inputs = make_inputs(TINY)
    runs = []
    for config in (TINY, TINY.replace(**recompute_fields(recompute))):
        model = _model(config, ref)
        calls = count_block_forwards([*model.double_blocks, *model.single_blocks])
        loss = model(**inputs).square().sum()
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, list(calls)))
    (plain_loss, plain, plain_calls), (loss, grads, calls) = runs
    assert torch.equal(plain_loss, loss)
    for name, g in plain.items():
        assert torch.equal(g, grads[name]), name
    assert plain_calls == [1] * 6
    assert calls == {"uniform1": [2] * 6, "uniform4": [2] * 6, "block3": [2, 2, 2, 1, 1, 1]}[
        f"{recompute.method}{recompute.num_layers}"]


def test_compiled_blocks_match_eager_and_share_their_code(parallel_1proc):
    """torch.compile'd blocks (inductor) give the eager outputs and gradients to 1e-5, with and
    without activation checkpointing, and one compiled graph serves every block of a kind. The blocks
    are compiled in place: state_dict, train() and eval() see the eager model's module tree. Where
    MindSpeed's adaptor made torch.compile compile nothing (MindSpeed-MM's environment, as on Ascend),
    compile_blocks is refused in one line instead of running eager unannounced."""
    import torch._dynamo
    from mm_grpo.platform.adaptor import torch_compile_replaced
    if torch_compile_replaced():
        assert torch.compile.__module__.startswith("mindspeed")
        assert_one_line_error(lambda: _model(TINY.replace(compile_blocks=True), random_reference(TINY, seed=6)),
                              "replaced torch.compile")
        return
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ref = random_reference(TINY, seed=6)
    inputs = make_inputs(TINY, batch=2, height=3, width=4, txt_len=5)
    results, models = [], []
    for config in (TINY, TINY.replace(compile_blocks=True), TINY.replace(compile_blocks=True, **recompute_fields(EVERY_BLOCK))):
        model = _model(config, ref)
        out = model(**inputs)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
        models.append(model)
    # Compiled in place: the module tree, its state_dict and train() / eval() are the eager model's
    # (a compiled wrapper kept as a child of its block made them recurse without end).
    eager, compiled = models[0], models[1]
    assert all(b._compiled_call_impl is not None for b in [*compiled.double_blocks, *compiled.single_blocks])
    assert [n for n, _ in compiled.named_modules()] == [n for n, _ in eager.named_modules()]
    state = compiled.state_dict()
    assert state.keys() == eager.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in eager.state_dict().items() if torch.is_tensor(v))
    assert not any(m.training for m in compiled.eval().modules())
    assert all(m.training for m in compiled.train().modules())
    for out, grads in results[1:]:
        assert rel_err(out, results[0][0]) <= TOL
        for name, g in results[0][1].items():
            assert rel_err(grads[name], g) <= TOL, name
    # 2 double + 4 single blocks; a graph per block kind, forward and backward (x2 for the
    # recompute variant): not one per block.
    assert 0 < torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4


def test_bf16_stays_close_and_rope_stays_fp32(parallel_1proc):
    ref = random_reference(TINY, seed=4)
    inputs = make_inputs(TINY)
    fp32 = _model(TINY, ref)
    bf16 = _model(TINY.replace(bf16=True), ref)
    with torch.no_grad():
        expected, out = fp32(**inputs), bf16(**inputs)
    assert out.dtype == torch.bfloat16
    assert 0 < rel_err(out.float(), expected) < 5e-2
    cos, _ = bf16.rope(inputs["txt_ids"], inputs["img_ids"])
    assert cos.dtype == torch.float32


def test_linears_compute_in_the_activations_dtype(parallel_1proc):
    """On one TP rank the linears compute x W^T + b themselves (`layers.linear`), in the dtype of x:
    an fp32 weight and bias are cast for a bf16 call, the bias goes into the GEMM, and the output is
    bf16 (the compute dtype). fp32 calls give megatron-core's own output; megatron-core's
    tensor-parallel path (`layers._megatron`) runs under autocast to the activations' dtype and comes
    back in it. `forward_parts` equals the GEMM over the concatenation."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from mm_grpo import layers
    from mm_grpo.families.flux.transformer.model import transformer_config
    tconfig = transformer_config(TINY)
    column, row = layers.column_linear(16, 24, tconfig), layers.row_linear(24, 16, tconfig)
    for layer in (column, row):
        torch.nn.init.normal_(layer.bias)
    x, parts = torch.randn(5, 2, 16), [torch.randn(5, 2, 8), torch.randn(5, 2, 16)]
    whole = torch.cat(parts, -1)
    with torch.no_grad():
        for layer, inp, megatron in ((column, x, ColumnParallelLinear.forward),
                                     (row, whole, RowParallelLinear.forward)):
            assert rel_err(layer(inp)[0], megatron(layer, inp)[0]) <= 1e-6
            out = layer(inp.bfloat16())[0]
            assert out.dtype == torch.bfloat16
            assert torch.equal(out, torch.nn.functional.linear(inp.bfloat16(), layer.weight.bfloat16(),
                                                               layer.bias.bfloat16()))
            tp_path = layers._megatron(lambda t: megatron(layer, t), layer, inp.bfloat16())[0]
            assert tp_path.dtype == torch.bfloat16
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert torch.equal(tp_path, megatron(layer, inp.bfloat16())[0].bfloat16())
        assert rel_err(row.forward_parts(parts), row(whole)[0]) <= 1e-6
        bf16_parts = row.forward_parts([p.bfloat16() for p in parts])
        assert bf16_parts.dtype == torch.bfloat16
        assert 0 < rel_err(bf16_parts, row(whole)[0]) <= 1e-2


@pytest.mark.parametrize("kind", ["double_blocks", "single_blocks"])
def test_a_bf16_block_traces_to_one_graph(parallel_1proc, kind):
    """torch.compile sees a whole block as one graph in bf16, as in fp32: megatron-core's own linear
    path (which warns, a graph break, on every GEMM in 0.16) is not taken on one TP rank. On CUDA it
    was, and each linear recompiled until dynamo's limit (docs/performance.md)."""
    import torch._dynamo
    from mm_grpo import kernels
    model = FluxTransformer(TINY.replace(bf16=True))
    block = getattr(model, kind)[0]
    rope = kernels.rope_table(*model.rope(torch.zeros(4, 3), torch.zeros(12, 3)))
    x, vec = torch.randn(16, 2, TINY.hidden_size).bfloat16(), torch.randn(2, TINY.hidden_size).bfloat16()
    explained = torch._dynamo.explain(block)(x, 4, vec, rope, None)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_loads_from_a_diffusers_folder_and_a_pipeline_folder(parallel_1proc, tmp_path):
    ref = random_reference(TINY, seed=5)
    ref.save_pretrained(tmp_path / "pipe" / "transformer", max_shard_size="20KB")
    assert (tmp_path / "pipe" / "transformer" / "diffusion_pytorch_model.safetensors.index.json").exists()
    inputs = make_inputs(TINY)
    with torch.no_grad():
        expected = reference_output(ref, inputs)
        for path in (tmp_path / "pipe" / "transformer", tmp_path / "pipe"):
            config = FluxConfig.from_diffusers_config(str(path / "transformer") if path.name == "pipe"
                                                      else str(path))
            model = load_hf_weights(FluxTransformer(config), str(path))
            assert rel_err(model(**inputs), expected) <= TOL


def test_config_roundtrips_through_diffusers_config(tmp_path):
    for name in ("flux-dev", "flux-schnell", "tiny"):
        config = FluxConfig.preset(name)
        (tmp_path / "config.json").write_text(json.dumps(config.to_diffusers_config()))
        assert FluxConfig.from_diffusers_config(str(tmp_path)) == config
    dev = FluxConfig.preset("flux-dev")
    assert (dev.hidden_size, dev.num_blocks, dev.guidance_embeds) == (3072, 57, True)
    assert not FluxConfig.preset("flux-schnell").guidance_embeds


def test_full_size_parameter_count_matches_flux1_dev():
    from mm_grpo.families.flux.transformer.hf_weights import expected_hf_shapes
    shapes = expected_hf_shapes(FluxConfig.preset("flux-dev"))
    assert len(shapes) == 1160
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 11_901_408_320


# --- bad input -------------------------------------------------------------------------
def test_tp_not_dividing_heads_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_attention_heads \(24\) must be divisible by "
                                         r"tensor-model-parallel size \(5\)"):
        check_parallel_sizes(FluxConfig.preset("flux-dev"), tp=5)
    with pytest.raises(ValueError, match=r"x context-parallel size \(3\)"):
        check_parallel_sizes(TINY, tp=1, cp=3)


def test_missing_unexpected_and_misshaped_weights_are_named(parallel_1proc):
    sd = random_reference(TINY).state_dict()
    model = FluxTransformer(TINY)
    missing = dict(sd)
    del missing["single_transformer_blocks.1.proj_mlp.bias"]
    with pytest.raises(ValueError, match=r"missing weights: single_transformer_blocks\.1\.proj_mlp\.bias"):
        load_hf_weights(model, missing)
    extra = dict(sd, **{"transformer_blocks.9.attn.to_q.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"unexpected weights: transformer_blocks\.9\.attn\.to_q\.weight"):
        load_hf_weights(model, extra)
    wrong = dict(sd, **{"transformer_blocks.0.attn.to_k.weight": torch.zeros(64, 32)})
    with pytest.raises(ValueError, match=r"wrong shapes: transformer_blocks\.0\.attn\.to_k\.weight is "
                                         r"\(64, 32\), expected \(64, 64\)"):
        load_hf_weights(model, wrong)


def test_missing_checkpoint_path_is_a_clear_error(parallel_1proc, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such FLUX checkpoint"):
        load_hf_weights(FluxTransformer(TINY), str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no diffusion_pytorch_model"):
        load_hf_weights(FluxTransformer(TINY), str(tmp_path / "empty"))
    (tmp_path / "empty" / "diffusion_pytorch_model.safetensors.index.json").write_text('{"metadata": {}}')
    assert_one_line_error(lambda: load_hf_weights(FluxTransformer(TINY), str(tmp_path / "empty")),
                          "is not a safetensors index .JSON with a 'weight_map'")
    (tmp_path / "empty" / "config.json").write_text('{"num_layers": 2,}')
    assert_one_line_error(lambda: FluxConfig.from_diffusers_config(str(tmp_path / "empty")), "config.json is not valid JSON")
    assert_one_line_error(lambda: FluxConfig.from_diffusers_config({"num_layers": 2, "num_single_layer": 4}),
                          r"unknown FLUX config field\(s\) \['num_single_layer'\]")


def test_guidance_model_without_guidance_is_a_clear_error(parallel_1proc):
    inputs = make_inputs(TINY)
    del inputs["guidance"]
    with pytest.raises(ValueError, match="pass `guidance`"):
        FluxTransformer(TINY)(**inputs)
