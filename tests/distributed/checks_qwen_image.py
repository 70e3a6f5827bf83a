"""Qwen-Image's transformer under TP, Ulysses SP and PP (virtual stages too) against diffusers and the
single-process model (fp32), with prompts of mixed lengths masked: the per-sample text mask must follow
each rank's text tokens through the all-to-all (tests/test_qwen_image_model.py holds the one process to
diffusers)."""
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mm_grpo.families.qwen_image.transformer import QwenImageTransformer, layout
from mm_grpo.families.qwen_image.transformer.hf_weights import load_hf_weights
from mm_grpo.parallel import ParallelConfig, initialize_parallel
from mm_grpo.parallel.state import STAT_DTYPE
from tests.distributed.worker import check
from tests.qwen_image_utils import TINY, make_inputs, random_reference, reference_output
from tests.utils import rel_err


def _world_max(value):
    t = torch.tensor(float(value), dtype=STAT_DTYPE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _grads_by_hf_name(model, config=TINY):
    """Whole (TP-gathered) gradients keyed by diffusers' names; the unused last text tail left out."""
    group = parallel_state.get_tensor_model_parallel_group()
    params = dict(model.named_parameters())
    grads = {}
    for rule in layout.stage_rules(config, model.block_range, model.pre_process, model.post_process):
        grad = params[rule.megatron].grad
        if grad is None:
            continue
        shards = [torch.empty_like(grad) for _ in range(group.size())]
        dist.all_gather(shards, grad.contiguous(), group=group)
        grads[rule.hf] = layout.unshard(rule, shards)
    return grads


def _layout_errors(parallel, inputs, seed):
    ref = random_reference(TINY, seed=seed)
    n_img = inputs["hidden_states"].shape[1]
    weight = torch.randn(len(inputs["timestep"]), n_img, TINY.output_channels, generator=torch.Generator().manual_seed(1))
    expected = reference_output(ref, inputs)
    initialize_parallel(ParallelConfig())
    single = load_hf_weights(QwenImageTransformer(TINY), ref.state_dict())
    (single(**inputs) * weight).sum().backward()
    ref_grads = _grads_by_hf_name(single)

    initialize_parallel(parallel)
    model = load_hf_weights(QwenImageTransformer(TINY), ref.state_dict())
    out = model(**inputs)
    (out * weight).sum().backward()  # the same loss on every SP rank, each back-propagates its tokens
    for p in model.parameters():  # so the true gradient is the sum of the SP ranks' shares
        if p.grad is not None:
            dist.all_reduce(p.grad, group=parallel_state.get_context_parallel_group())
    grads = _grads_by_hf_name(model)
    return {"out_vs_diffusers": _world_max(rel_err(out.detach(), expected)),
            "grad_err": _world_max(max(rel_err(g, ref_grads[n]) for n, g in grads.items())),
            "same_grads": sorted(grads) == sorted(ref_grads), "n_grads": len(grads)}


@check(4)
def qwen_image_tp_sp_with_masked_text_match_single_process():
    """TP2 x SP2 and SP4, each with 3 prompts of 7, 2 and 5 tokens (padded to 7: not a multiple of the
    SP size, so SP pads the text too) on a 3 x 5 grid (15 image tokens: padded as well)."""
    inputs = make_inputs(TINY, lengths=(7, 2, 5), height=3, width=5, seed=2)
    return {name: _layout_errors(parallel, inputs, seed=4)
            for name, parallel in (("tp2_sp2", ParallelConfig(tp=2, cp=2)), ("sp4", ParallelConfig(cp=4)),
                                   ("tp4", ParallelConfig(tp=4)))}


# --- pipeline stages (with TP, SP and virtual stages) through megatron-core's schedules ------------
PP_CONFIG = TINY.replace(num_layers=4)  # one block per chunk at PP 4 and at PP 2 x 2 virtual stages
NUM_MICRO_BATCHES = 4


def _micro_batches():
    """Micro-batches of 2 prompts each, of other lengths in each (padded to 6 tokens), on a 3 x 5 grid,
    with a random weight for the loss."""
    mbs = []
    for i, lengths in enumerate([(6, 2), (3, 6), (1, 6), (6, 6)]):
        mb = make_inputs(PP_CONFIG, lengths, height=3, width=5, seed=10 + i)
        mb["encoder_hidden_states_mask"] = torch.arange(6) < torch.tensor(lengths)[:, None]
        mb["weight"] = torch.randn(2, 15, PP_CONFIG.output_channels, generator=torch.Generator().manual_seed(20 + i))
        mbs.append(mb)
    return mbs


def _loss_fn(output, mb):
    return (output * mb["weight"]).sum(), {"out": output.detach()}


def _pipeline_errors(parallel, ref, micro_batches, ref_outs, ref_grads):
    from mm_grpo.families.qwen_image.chunks import build_model_chunks, forward_backward, load_hf_weights_into_chunks
    initialize_parallel(parallel)
    chunks = load_hf_weights_into_chunks(build_model_chunks(PP_CONFIG), ref.state_dict())
    results = forward_backward(chunks, micro_batches, _loss_fn)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for p in (p for chunk in chunks for p in chunk.parameters() if p.grad is not None):
        dist.all_reduce(p.grad, group=group)  # what Megatron DDP does: the mean over DP x CP
        p.grad /= group.size()
    grads = {name: g for chunk in chunks for name, g in _grads_by_hf_name(chunk, PP_CONFIG).items()}
    covered = [None] * dist.get_world_size()
    dist.all_gather_object(covered, sorted(grads))
    return {"out_err": _world_max(max(rel_err(r["out"], o) for r, o in zip(results, ref_outs))),
            "grad_err": _world_max(max(rel_err(g, ref_grads[n]) for n, g in grads.items())),
            "all_grads_compared": {n for names in covered for n in names} == set(ref_grads),
            "n_grads": len(ref_grads), "n_micro_batches": len(results)}


@check(4)
def qwen_image_pipeline_layouts_match_single_process():
    """TP2 x PP2, PP2 x SP2, PP4 and PP2 x 2 virtual stages (x DP2) against the one process: every
    micro-batch's output and d(mean loss)/dw of every parameter."""
    ref = random_reference(PP_CONFIG, seed=3)
    micro_batches = _micro_batches()
    initialize_parallel(ParallelConfig())
    single = load_hf_weights(QwenImageTransformer(PP_CONFIG), ref.state_dict())
    outs = [single(**{k: v for k, v in mb.items() if k != "weight"}) for mb in micro_batches]
    (sum(_loss_fn(o, mb)[0] for o, mb in zip(outs, micro_batches)) / len(outs)).backward()
    ref_outs, ref_grads = [o.detach() for o in outs], _grads_by_hf_name(single, PP_CONFIG)
    layouts = {"tp2_pp2": ParallelConfig(tp=2, pp=2), "pp2_sp2": ParallelConfig(pp=2, cp=2),
               "pp4": ParallelConfig(pp=4), "pp2_vpp2": ParallelConfig(pp=2, vpp=2)}
    return {name: _pipeline_errors(parallel, ref, micro_batches, ref_outs, ref_grads)
            for name, parallel in layouts.items()}


@check(4)
def qwen_image_pipelined_true_cfg_velocity_matches_single_process():
    """The rollout's velocity with true CFG (4 prompts of other lengths, micro-batches of 2, the negative
    prompt padded to them) at PP2 x SP2 and PP2 x 2 virtual stages, on every rank, against the one process."""
    from mm_grpo.families.qwen_image.chunks import build_model_chunks, load_hf_weights_into_chunks
    from mm_grpo.families.qwen_image.denoiser import QwenImageDenoiser
    ref = random_reference(PP_CONFIG, seed=9)
    inputs = make_inputs(PP_CONFIG, (7, 2, 5, 7), height=3, width=5, seed=5)
    g = torch.Generator().manual_seed(6)
    negative = (torch.randn(1, 4, PP_CONFIG.joint_attention_dim, generator=g), None)
    denoiser = QwenImageDenoiser(48, 80, PP_CONFIG.in_channels, 4.0, negative)
    cond = denoiser.conditioning((inputs["encoder_hidden_states"], inputs["encoder_hidden_states_mask"]), None,
                                 torch.device("cpu"))
    x, sigma = inputs["hidden_states"], inputs["timestep"]
    initialize_parallel(ParallelConfig())
    single = load_hf_weights(QwenImageTransformer(PP_CONFIG), ref.state_dict())
    expected = denoiser.velocity_fn([single], cond, micro_batch_size=2)(x, sigma)
    errs = {}
    for name, parallel in (("pp2_sp2", ParallelConfig(pp=2, cp=2)), ("pp2_vpp2", ParallelConfig(pp=2, vpp=2))):
        initialize_parallel(parallel)
        chunks = load_hf_weights_into_chunks(build_model_chunks(PP_CONFIG), ref.state_dict())
        errs[name] = _world_max(rel_err(denoiser.velocity_fn(chunks, cond, micro_batch_size=2)(x, sigma), expected))
    return errs


# --- Megatron checkpoints of other layouts loaded into a running model ------------------------------
CHECKPOINT_LAYOUTS = {"tp4": (4, None), "pp2": (1, [1, 3]), "tp2_vpp2": (2, [[1, 1], [1, 1]])}  # (TP, pp_layers)


@check(4)
def qwen_image_checkpoints_of_other_layouts_load_into_running_pipelines():
    """Checkpoints converted (mm-convert QwenImageConverter hf_to_mm, on rank 0) at TP4, at PP2 with stages
    of 1 and 3 blocks and at TP2 x 2 virtual stages, loaded into a running TP2 x PP2 and PP2 x 2 virtual
    stages model: every weight of every rank equals diffusers' weights loaded directly."""
    import shutil
    import tempfile
    from converters.convert_cli import main as mm_convert
    from mm_grpo.families.qwen_image.checkpoint import load_megatron_checkpoint
    from mm_grpo.families.qwen_image.chunks import build_model_chunks, load_hf_weights_into_chunks
    ref = random_reference(PP_CONFIG, seed=12)
    paths = [tempfile.mkdtemp(prefix="checks_qwen_image-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(paths, src=0)
    tmp = paths[0]
    try:
        if dist.get_rank() == 0:
            ref.save_pretrained(f"{tmp}/hf")
            for name, (tp, pp_layers) in CHECKPOINT_LAYOUTS.items():
                stages = [] if pp_layers is None else ["--cfg.target_parallel_config.pp_layers", str(pp_layers)]
                mm_convert(["QwenImageConverter", "hf_to_mm", "--cfg.source_path", f"{tmp}/hf", "--cfg.target_path",
                            f"{tmp}/{name}", "--cfg.target_parallel_config.tp_size", str(tp), *stages])
        dist.barrier()
        results = {}
        for running, parallel in (("tp2_pp2", ParallelConfig(tp=2, pp=2)), ("pp2_vpp2", ParallelConfig(pp=2, vpp=2))):
            initialize_parallel(parallel)
            direct = load_hf_weights_into_chunks(build_model_chunks(PP_CONFIG), ref.state_dict())
            expected = [dict(c.named_parameters()) for c in direct]
            results[running] = {"params_on_a_rank": int(_world_max(sum(len(e) for e in expected)))}  # the most
            for name in CHECKPOINT_LAYOUTS:
                chunks = build_model_chunks(PP_CONFIG)
                load_megatron_checkpoint(chunks, f"{tmp}/{name}")
                differ = any(not torch.equal(p, want[n]) for c, want in zip(chunks, expected)
                             for n, p in c.named_parameters())
                results[running][name] = not _world_max(differ)  # on every rank
        return results
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


# --- LoRA adapters at TP x PP ------------------------------------------------------------------
def _adapter_grads_by_hf_name(chunk, targets):
    """Whole (TP-gathered) adapter gradients keyed by diffusers' names; those without one (the last
    block's text tail) left out."""
    from mm_grpo.families.qwen_image.transformer import lora
    group = parallel_state.get_tensor_model_parallel_group()
    params = dict(chunk.named_parameters())
    grads = {}
    for rule in lora.chunk_adapter_rules(chunk, targets):
        grad = params[rule.megatron].grad
        if grad is None:
            continue
        shards = [torch.empty_like(grad) for _ in range(group.size())]
        dist.all_gather(shards, grad.contiguous(), group=group)
        grads[rule.hf] = layout.unshard(rule, shards)
    return grads


@check(4)
def qwen_image_lora_tp2_pp2_matches_single_process():
    """Adapters on every target (random A and B, whole, then sharded like their linears) at TP2 x PP2
    through megatron-core's schedules, 4 micro-batches of prompts of other lengths, against the one
    process: every micro-batch's output and d(mean loss)/d(A, B) of every adapter."""
    from mm_grpo.families.qwen_image.chunks import build_model_chunks, forward_backward, load_hf_weights_into_chunks
    from mm_grpo.families.qwen_image.transformer import lora
    from mm_grpo.families.qwen_image.transformer.hf_weights import expected_hf_shapes
    config = lora.LoRAConfig(r=4, alpha=8.0, targets=tuple(lora.TARGETS))
    shapes, g = expected_hf_shapes(PP_CONFIG), torch.Generator().manual_seed(14)
    full = {base.hf[0]: (torch.randn(config.r, shapes[base.hf[0]][1], generator=g) * 0.2,
                         torch.randn(sum(shapes[h][0] for h in base.hf), config.r, generator=g) * 0.2)
            for base in lora.base_rules(PP_CONFIG, config.targets)}

    def adapted(chunks):
        for chunk in chunks:
            lora.add_adapters(chunk, config, seed=1)
            lora.copy_full_adapters(chunk, full, config)
        return chunks

    ref = random_reference(PP_CONFIG, seed=13)
    micro_batches = _micro_batches()
    initialize_parallel(ParallelConfig())
    single = adapted([load_hf_weights(QwenImageTransformer(PP_CONFIG), ref.state_dict())])[0]
    outs = [single(**{k: v for k, v in mb.items() if k != "weight"}) for mb in micro_batches]
    (sum(_loss_fn(o, mb)[0] for o, mb in zip(outs, micro_batches)) / len(outs)).backward()
    ref_outs, ref_grads = [o.detach() for o in outs], _adapter_grads_by_hf_name(single, config.targets)

    initialize_parallel(ParallelConfig(tp=2, pp=2))
    chunks = adapted(load_hf_weights_into_chunks(build_model_chunks(PP_CONFIG), ref.state_dict()))
    results = forward_backward(chunks, micro_batches, _loss_fn)
    grads = {name: grad for chunk in chunks for name, grad in _adapter_grads_by_hf_name(chunk, config.targets).items()}
    covered = [None] * dist.get_world_size()
    dist.all_gather_object(covered, sorted(grads))
    frozen = any(p.grad is not None for c in chunks for n, p in c.named_parameters() if ".lora_" not in n)
    return {"out_err": _world_max(max(rel_err(r["out"], o) for r, o in zip(results, ref_outs))),
            "grad_err": _world_max(max(rel_err(g, ref_grads[n]) for n, g in grads.items())),
            "all_grads_compared": {n for names in covered for n in names} == set(ref_grads),
            "n_grads": len(ref_grads), "n_micro_batches": len(results), "base_frozen": not _world_max(frozen)}
