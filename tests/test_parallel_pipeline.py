"""The pipeline helpers in one process (PP = 1: megatron-core's no-pipelining schedule) and
the clear errors for layouts that do not fit. Multi-process parity: tests/distributed."""
import pytest
import torch

from mm_grpo.families.flux.chunks import build_model_chunks, forward_backward, load_hf_weights_into_chunks, make_velocity_fn
from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer
from mm_grpo.families.flux.transformer.hf_weights import load_hf_weights
from mm_grpo.families.flux.transformer.model import check_parallel_sizes
from mm_grpo.parallel import ParallelConfig
from mm_grpo.parallel.pipeline_layout import resolve_pp_layers
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.utils import make_inputs, random_reference, rel_err

TOL = 1e-5
TINY = FluxConfig.preset("tiny")


# --- layouts ----------------------------------------------------------------------------
def test_pp_layers_default_to_an_even_split():
    assert resolve_pp_layers(None, 8, pp=4, vpp=1) == [[2, 2, 2, 2]]
    assert resolve_pp_layers(None, 8, pp=2, vpp=2) == [[2, 2], [2, 2]]
    assert resolve_pp_layers([3, 5], 8, pp=2, vpp=1) == [[3, 5]]
    assert resolve_pp_layers([[1, 3], [2, 2]], 8, pp=2, vpp=2) == [[1, 3], [2, 2]]


@pytest.mark.parametrize("pp_layers,pp,vpp,message", [
    (None, 4, 1, r"6 blocks do not split evenly over 4 pipeline stages x 1 virtual stages: pass pp_layers"),
    (None, 2, 2, r"6 blocks do not split evenly over 2 pipeline stages x 2 virtual stages"),
    ([2, 2, 1], 3, 1, r"pp_layers \[2, 2, 1\] sums to 5, but the model has 6 blocks"),
    ([3, 3], 3, 1, r"pp_layers \[3, 3\] has 2 stages, but the pipeline-model-parallel size is 3"),
    ([3, 3], 2, 2, r"has 1 virtual chunk\(s\) per stage, but the virtual pipeline size is 2"),
    ([[1, 2], [3]], 2, 2, r"every virtual chunk needs one count per stage"),
    ([0, 6], 2, 1, r"every stage needs a whole number >= 1 of blocks"),
])
def test_pp_layers_that_do_not_fit_are_clear_errors(pp_layers, pp, vpp, message):
    with pytest.raises(ValueError, match=message):
        resolve_pp_layers(pp_layers, TINY.num_blocks, pp, vpp)


@pytest.mark.parametrize("parallel,world,message", [
    (ParallelConfig(tp=2, cp=2), 6, r"world size 6 is not divisible by TP x PP x CP = 2 x 1 x 2"),
    (ParallelConfig(pp=1, vpp=2), 4, r"virtual pipeline size 2 needs vpp >= 2 and pipeline-model-parallel size >= 2"),
    (ParallelConfig(pp=4, vpp=1), 4, r"virtual pipeline size 1 needs vpp >= 2"),
    (ParallelConfig(cp=2, cp_algo="megatron_cp_algo"), 2, r"only 'ulysses_cp_algo' is supported"),
])
def test_parallel_sizes_that_do_not_fit_are_clear_errors(parallel, world, message):
    with pytest.raises(ValueError, match=message):
        parallel.check(world)


def test_heads_must_divide_by_tp_times_sp():
    check_parallel_sizes(TINY, tp=2, cp=2)  # 4 heads
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by tensor-model-"
                                         r"parallel size \(2\) x context-parallel size \(4\)"):
        check_parallel_sizes(TINY, tp=2, cp=4)


# --- PP = 1: the helpers against plain forward / backward -------------------------------
def _micro_batches(n=3, batch=2):
    mbs = []
    for i in range(n):
        mb = make_inputs(TINY, batch=batch, height=3, width=4, txt_len=5, seed=i)
        mb["weight"] = torch.randn(batch, 12, TINY.output_channels, generator=torch.Generator().manual_seed(i))
        mbs.append(mb)
    return mbs


def _loss_fn(out, mb):
    loss = (out * mb["weight"]).mean()
    return loss, {"out_mean": out.mean().detach(), "tag": "x"}


def test_forward_backward_without_pipeline_matches_plain_backward(parallel_1proc):
    ref = random_reference(TINY, seed=1)
    micro_batches = _micro_batches()
    plain = load_hf_weights(FluxTransformer(TINY), ref.state_dict())
    losses = [_loss_fn(plain(**{k: v for k, v in mb.items() if k != "weight"}), mb)[0] for mb in micro_batches]
    (sum(losses) / len(losses)).backward()

    chunks = load_hf_weights_into_chunks(build_model_chunks(TINY), ref.state_dict())
    assert len(chunks) == 1 and chunks[0].pre_process and chunks[0].post_process
    results = forward_backward(chunks, micro_batches, _loss_fn)
    assert [r["loss"].item() for r in results] == pytest.approx([x.item() for x in losses], rel=TOL)
    assert results[0]["tag"] == "x" and results[0]["out_mean"].device.type == "cpu"
    grads = dict(plain.named_parameters())
    for name, p in chunks[0].named_parameters():
        assert rel_err(p.grad, grads[name].grad) <= TOL, name


def test_velocity_fn_without_pipeline_matches_the_model(parallel_1proc):
    ref = random_reference(TINY, seed=2)
    inputs = make_inputs(TINY, batch=4, height=2, width=3, txt_len=4)
    cond = {k: inputs[k] for k in ("encoder_hidden_states", "pooled_projections", "txt_ids", "img_ids",
                                   "guidance")}
    chunks = load_hf_weights_into_chunks(build_model_chunks(TINY), ref.state_dict())
    with torch.no_grad():
        expected = chunks[0](**inputs)
    v = make_velocity_fn(chunks, cond, micro_batch_size=2)(inputs["hidden_states"], inputs["timestep"])
    assert v.shape == expected.shape and rel_err(v, expected) <= TOL


def test_pipeline_helpers_reject_inputs_that_do_not_fit(parallel_1proc):
    chunks = build_model_chunks(TINY)
    inputs = make_inputs(TINY, batch=4, height=2, width=3, txt_len=4)
    cond = {k: inputs[k] for k in ("encoder_hidden_states", "pooled_projections", "txt_ids", "img_ids")}
    with pytest.raises(ValueError, match="batch size 4 is not divisible by micro_batch_size 3"):
        make_velocity_fn(chunks, cond, micro_batch_size=3)
    velocity_fn = make_velocity_fn(chunks, cond, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"velocity_fn takes x \[4, S_img, C\] and sigma \[4\]"):
        velocity_fn(inputs["hidden_states"][:2], inputs["timestep"][:2])
    odd = _micro_batches(2) + [make_inputs(TINY, batch=2, height=2, width=2, txt_len=5)]
    with pytest.raises(ValueError, match=r"micro-batches differ in \(batch, text tokens, image tokens\)"):
        forward_backward(chunks, odd, _loss_fn)
    with pytest.raises(ValueError, match="no micro-batches given"):
        forward_backward(chunks, [], _loss_fn)
