"""Pipeline and Ulysses sequence parallelism (with TP) against the single-process model (fp32).

Each check runs the same micro-batches through the single-process model (TP = PP = CP = 1,
the model that tests/test_flux_model.py matches to diffusers) and through one parallel
layout, on every rank, and reports the worst relative error over all ranks.
"""
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

from mm_grpo.families.flux.chunks import (build_model_chunks, forward_backward, load_hf_weights_into_chunks,
                                       make_velocity_fn)
from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer, layout
from mm_grpo.families.flux.transformer.hf_weights import load_hf_weights
from mm_grpo.parallel import ParallelConfig, initialize_parallel
from mm_grpo.parallel.state import STAT_DTYPE
from tests.distributed.worker import check
from tests.utils import gather_tp, make_inputs, random_reference, reference_output, rel_err

# 8 blocks (2 double + 6 single) so that PP 4 x 2 virtual stages has one block per chunk.
CONFIG = FluxConfig.preset("tiny").replace(num_single_layers=6)
NUM_MICRO_BATCHES = 4


def _micro_batches(height, width, txt_len, batch=2):
    """Micro-batches with diffusers' forward kwargs and a random weight for the loss."""
    mbs = []
    for i in range(NUM_MICRO_BATCHES):
        mb = make_inputs(CONFIG, batch=batch, height=height, width=width, txt_len=txt_len, seed=10 + i)
        mb["weight"] = torch.randn(batch, height * width, CONFIG.output_channels,
                                   generator=torch.Generator().manual_seed(20 + i))
        mbs.append(mb)
    return mbs


def _loss_fn(output, mb):
    return (output * mb["weight"]).sum(), {"out": output.detach()}


def _loss_err(loss, ref_out, mb):
    """|loss - reference| relative to the sum of |terms| (the loss is a sum with cancellation)."""
    return (abs(loss.item() - _loss_fn(ref_out, mb)[0].item()) / (ref_out * mb["weight"]).abs().sum()).item()


def _grads_by_hf_name(chunk):
    """Full (TP-gathered) gradients of a chunk, keyed by the global diffusers names."""
    full = gather_tp(chunk, "grad")
    rules = layout.stage_rules(chunk.flux_config, chunk.block_range, chunk.pre_process, chunk.post_process)
    return {rule.hf: full[rule.megatron] for rule in rules}


def _reference(ref, micro_batches):
    """Outputs and d(mean loss)/dw of the single-process model."""
    initialize_parallel(ParallelConfig())
    model = load_hf_weights(FluxTransformer(CONFIG), ref.state_dict())
    outs, losses = [], []
    for mb in micro_batches:
        out = model(**{k: v for k, v in mb.items() if k != "weight"})
        outs.append(out.detach())
        losses.append(_loss_fn(out, mb)[0])
    (sum(losses) / len(losses)).backward()
    return outs, _grads_by_hf_name(model)


def _average_over_dp_cp(chunks):
    """What Megatron DDP does: average gradients over the data-parallel-with-CP group."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for chunk in chunks:
        for p in chunk.parameters():
            dist.all_reduce(p.grad, group=group)  # gloo has no AVG
            p.grad /= group.size()


def _world_max(value):
    t = torch.tensor(float(value), dtype=STAT_DTYPE)  # not float64: MindSpeed leaves that unreduced
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _wrap_in_megatron_ddp(chunks):
    """Megatron DDP around the chunks; its finalize_model_grads reduces over DP x CP."""
    tconfig = chunks[0].config
    ddp = [DistributedDataParallel(tconfig, DistributedDataParallelConfig(), chunk) for chunk in chunks]
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = ddp[0].no_sync
    return ddp


def _compare_layout(parallel, pp_layers=None, height=3, width=4, txt_len=5, megatron_ddp=False):
    """forward_backward at `parallel` vs the single-process model: output and gradient errors."""
    ref = random_reference(CONFIG, seed=3)
    micro_batches = _micro_batches(height, width, txt_len)
    ref_outs, ref_grads = _reference(ref, micro_batches)

    initialize_parallel(parallel)
    chunks = load_hf_weights_into_chunks(build_model_chunks(CONFIG, pp_layers), ref.state_dict())
    if megatron_ddp:
        results = forward_backward(_wrap_in_megatron_ddp(chunks), micro_batches, _loss_fn)
        for p in (p for chunk in chunks for p in chunk.parameters()):
            p.grad = p.main_grad  # DDP accumulates into its buffer
    else:
        results = forward_backward(chunks, micro_batches, _loss_fn)
        _average_over_dp_cp(chunks)
    grads = {name: g for chunk in chunks for name, g in _grads_by_hf_name(chunk).items()}

    covered = [None] * dist.get_world_size()
    dist.all_gather_object(covered, sorted(grads))
    out_err = max(rel_err(r["out"], o) for r, o in zip(results, ref_outs))
    grad_errs = {name: rel_err(g, ref_grads[name]) for name, g in grads.items()}
    worst = max(grad_errs, key=grad_errs.get)
    return {
        "out_err": _world_max(out_err),
        "loss_err": _world_max(max(_loss_err(r["loss"], o, mb) for r, o, mb in zip(results, ref_outs, micro_batches))),
        "grad_err": _world_max(grad_errs[worst]),
        "all_grads_compared": {n for names in covered for n in names} == set(ref_grads),
        "n_grads": len(ref_grads),
        "n_micro_batches": len(results),
    }


# --- training: forward_backward at each layout (world size 4) ----------------------------
@check(4)
def tp2_sp2_matches_single_process():
    return _compare_layout(ParallelConfig(tp=2, cp=2))


@check(4)
def tp2_pp2_matches_single_process():
    return _compare_layout(ParallelConfig(tp=2, pp=2), pp_layers=[3, 5])


@check(4)
def pp2_sp2_matches_single_process():
    # 3 x 5 = 15 image and 9 text tokens: both padded to a multiple of SP = 2.
    return _compare_layout(ParallelConfig(pp=2, cp=2), height=3, width=5, txt_len=9)


@check(4)
def pp2_sp2_megatron_ddp_matches_single_process():
    """The trainer's path: Megatron DDP + finalize_model_grads inside the schedule."""
    return _compare_layout(ParallelConfig(pp=2, cp=2), height=3, width=5, txt_len=9, megatron_ddp=True)


@check(4)
def pp4_matches_single_process():
    return _compare_layout(ParallelConfig(pp=4), pp_layers=[1, 2, 3, 2])


@check(4)
def pp4_vpp2_matches_single_process():
    metrics = _compare_layout(ParallelConfig(pp=4, vpp=2))
    chunks = build_model_chunks(CONFIG)
    try:  # megatron-core's interleaved schedule takes micro-batches in groups of PP
        forward_backward(chunks, _micro_batches(3, 4, 5)[:3], _loss_fn)
    except ValueError as e:
        metrics["three_micro_batches_error"] = str(e)
    return metrics


@check(4)
def sp4_uneven_matches_single_process():
    # 3 x 5 = 15 image tokens, 7 text tokens: neither divides by SP = 4.
    return _compare_layout(ParallelConfig(cp=4), height=3, width=5, txt_len=7)


@check(2)
def sp2_uneven_and_pp2_vpp2_match_single_process():
    sp = _compare_layout(ParallelConfig(cp=2), height=3, width=5, txt_len=7)
    pp = _compare_layout(ParallelConfig(pp=2, vpp=2), pp_layers=[[1, 3], [2, 2]])
    return {f"{name}_{k}": v for name, m in (("sp2", sp), ("pp2_vpp2", pp)) for k, v in m.items()}


@check(2)
def bf16_forward_pp2_sp2_match_single_process_bf16():
    """bf16: a stage boundary changes nothing (the stage tensor carries the bf16 residual stream and
    silu(temb) as they are); SP only rounds."""
    ref, config = random_reference(CONFIG, seed=3), CONFIG.replace(bf16=True)
    micro_batches = _micro_batches(3, 5, 7)
    initialize_parallel(ParallelConfig())
    single = load_hf_weights(FluxTransformer(config), ref.state_dict())
    with torch.no_grad():
        expected = [single(**{k: v for k, v in mb.items() if k != "weight"}).float() for mb in micro_batches]
    errs = {}
    for name, parallel in (("pp2", ParallelConfig(pp=2)), ("sp2", ParallelConfig(cp=2))):
        initialize_parallel(parallel)
        chunks = load_hf_weights_into_chunks(build_model_chunks(config), ref.state_dict())
        results = forward_backward(chunks, micro_batches, _loss_fn, forward_only=True)
        assert results[0]["out"].dtype == torch.bfloat16
        errs[name] = _world_max(max(rel_err(r["out"].float(), e) for r, e in zip(results, expected)))
    return errs


# --- the plain forward under SP: gathered output, gradients through the all-to-alls ------
@check(4)
def sp_direct_forward_matches_diffusers():
    """model(...) itself at TP2 x SP2 with padding: output = diffusers', summed grads = single-process."""
    ref = random_reference(CONFIG, seed=5)
    inputs = make_inputs(CONFIG, batch=2, height=3, width=3, txt_len=5)
    weight = torch.randn(2, 9, CONFIG.output_channels, generator=torch.Generator().manual_seed(1))
    expected = reference_output(ref, inputs)
    initialize_parallel(ParallelConfig())
    single = load_hf_weights(FluxTransformer(CONFIG), ref.state_dict())
    (single(**inputs) * weight).sum().backward()
    ref_grads = _grads_by_hf_name(single)

    initialize_parallel(ParallelConfig(tp=2, cp=2))
    model = load_hf_weights(FluxTransformer(CONFIG), ref.state_dict())
    out = model(**inputs)
    (out * weight).sum().backward()  # the same loss on every SP rank, each back-propagates its tokens
    for p in model.parameters():  # so the true gradient is the sum of the SP ranks' shares
        dist.all_reduce(p.grad, group=parallel_state.get_context_parallel_group())
    grads = _grads_by_hf_name(model)
    return {"out_vs_diffusers": _world_max(rel_err(out.detach(), expected)),
            "grad_err": _world_max(max(rel_err(g, ref_grads[n]) for n, g in grads.items())),
            "n_grads": len(grads), "n_ref_grads": len(ref_grads)}


# --- pipelined forward-only inference over a 16-step Euler sampling loop --------------------
def _sigmas(steps=16, shift=3.0):
    s = torch.linspace(1, 0, steps + 1)
    return shift * s / (1 + (shift - 1) * s)


def _euler(velocity_fn, x, sigmas):
    for i in range(len(sigmas) - 1):
        x = x + (sigmas[i + 1] - sigmas[i]) * velocity_fn(x, sigmas[i].repeat(x.shape[0]))
    return x


def _sampling_error(parallel, pp_layers=None, micro_batch_size=1):
    ref = random_reference(CONFIG, seed=7, std=0.05)
    inputs = make_inputs(CONFIG, batch=4, height=3, width=5, txt_len=7, seed=4)
    cond = {k: inputs[k] for k in ("encoder_hidden_states", "pooled_projections", "txt_ids", "img_ids",
                                   "guidance")}
    noise, sigmas = inputs["hidden_states"], _sigmas()

    initialize_parallel(ParallelConfig())
    single = load_hf_weights(FluxTransformer(CONFIG), ref.state_dict())
    with torch.no_grad():
        expected = _euler(lambda x, s: single(x, timestep=s, **cond), noise, sigmas)

    initialize_parallel(parallel)
    chunks = load_hf_weights_into_chunks(build_model_chunks(CONFIG, pp_layers), ref.state_dict())
    latents = _euler(make_velocity_fn(chunks, cond, micro_batch_size), noise, sigmas)
    # Every rank must hold the same latents to step its sampler: compare all of them.
    return _world_max(rel_err(latents, expected))


@check(4)
def pipelined_inference_16_steps_matches_single_process():
    # (PP = 1 is checked in one process: tests/test_parallel_pipeline.py.)
    return {"pp2_sp2_mbs2": _sampling_error(ParallelConfig(pp=2, cp=2), micro_batch_size=2),
            # 2 micro-batches: padded to a multiple of PP for the interleaved schedule.
            "pp4_vpp2_mbs2": _sampling_error(ParallelConfig(pp=4, vpp=2), micro_batch_size=2)}
