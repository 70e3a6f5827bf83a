"""FLUX built by MindSpeed-MM's own `PredictModel` at TP / PP / virtual-stage layouts, loaded by
its own `load_checkpoint` from one diffusers file, against diffusers (fp32).

Imported by the worker only in MindSpeed-MM's environment (tests/testbed.py); each check builds
this rank's chunks the way MindSpeed-MM's model provider does (one `PredictModel` per virtual
stage, the virtual rank set before each), runs them through megatron-core's pipeline schedule
and reports the worst relative error of the output against diffusers over all ranks.
"""
import contextlib
import io
import os
import tempfile
import types

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import save_file

from mm_grpo.families.flux.chunks import forward_backward
from mm_grpo.families.flux.transformer import FluxConfig
from mm_grpo.parallel import ParallelConfig, initialize_parallel
from mm_grpo.parallel.state import STAT_DTYPE
from tests.distributed.worker import check
from tests.testbed import install_standins
from tests.utils import (_gather_whole, gather_tp, make_inputs, random_adapters, random_reference, reference_output,
                         rel_err)

install_standins()
import mm_grpo.mindspeed_mm.registry  # noqa: E402,F401  (registers flux as MindSpeed-MM imports it)
from mindspeed_mm.configs.config import ConfigReader  # noqa: E402
from mindspeed_mm.models.predictor import PredictModel  # noqa: E402

CONFIG = FluxConfig.preset("tiny").replace(num_single_layers=6)  # 8 blocks: 2 double + 6 single


def predictor_block(path, pipeline_num_layers=None):
    """model.json's predictor block, written the MindSpeed-MM way (hyperparameters inline)."""
    block = {"model_id": "flux", "from_pretrained": path, "dtype": "fp32", **CONFIG.to_diffusers_config()}
    if pipeline_num_layers is not None:  # PredictModel: num_layers == sum(pipeline_num_layers)
        flat = [n for x in pipeline_num_layers for n in (x if isinstance(x, list) else [x])]
        block.update(pipeline_num_layers=pipeline_num_layers, num_layers=sum(flat))
    return block


def predict_model_chunks(block):
    """This rank's chunks, built and loaded by MindSpeed-MM's PredictModel; and what its
    load_checkpoint printed."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks, printed = [], io.StringIO()
    for v in range(vpp or 1):
        if vpp:
            parallel_state.set_virtual_pipeline_model_parallel_rank(v)
        with contextlib.redirect_stdout(printed):
            chunks.append(PredictModel(ConfigReader(block)).get_model())
    if vpp:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return chunks, printed.getvalue()


def _world_max(value):
    t = torch.tensor(float(value), dtype=STAT_DTYPE)  # not float64: MindSpeed leaves that unreduced
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _compare(parallel, pipeline_num_layers=None):
    ref = random_reference(CONFIG, seed=5)
    micro_batches = [make_inputs(CONFIG, batch=2, height=3, width=4, txt_len=5, seed=30 + i) for i in range(4)]
    with torch.no_grad():
        ref_outs = [reference_output(ref, mb) for mb in micro_batches]
    initialize_parallel(parallel)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "diffusion_pytorch_model.safetensors")
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
        chunks, printed = predict_model_chunks(predictor_block(path, pipeline_num_layers))
    with torch.no_grad():
        results = forward_backward(chunks, micro_batches, lambda out, mb: (out.sum(), {"out": out}),
                                   forward_only=True)
    blocks = [(len(c.double_blocks), len(c.single_blocks)) for c in chunks]
    all_blocks = [None] * dist.get_world_size()
    dist.all_gather_object(all_blocks, blocks)
    return {"out_err": _world_max(max(rel_err(r["out"], o) for r, o in zip(results, ref_outs))),
            "clean_load": _world_max(printed.count("Missing keys: []") != len(chunks)
                                     or printed.count("Unexpected keys: []") != len(chunks)) == 0,
            "blocks": all_blocks}


@check(2)
def predict_model_tp2_matches_diffusers():
    return _compare(ParallelConfig(tp=2))


@check(2)
def predict_model_pp2_matches_diffusers():
    return _compare(ParallelConfig(pp=2), pipeline_num_layers=[3, 5])


@check(2)
def predict_model_pp2_vpp2_matches_diffusers():
    return _compare(ParallelConfig(pp=2, vpp=2), pipeline_num_layers=[[1, 2], [2, 3]])


@check(4)
def predict_model_tp2_pp2_matches_diffusers():
    return _compare(ParallelConfig(tp=2, pp=2), pipeline_num_layers=[4, 4])


# --- flow matching through MindSpeed-MM's own pretrain_sora.py ------------------------------
def _sora_loss(tmp, ref, tp=1, cp=1):
    """pretrain_sora.py's model provider, forward step and loss at TP x CP on one feature batch,
    backpropagated and averaged as Megatron's schedule and DDP do: (the loss, i.e. loss_func's
    times CP; what the scheduler drew; the model; its full, TP-gathered gradients)."""
    from tests.sora_helpers import feature_batch, pretrain_sora, record_q_sample, set_megatron_args, write_configs
    initialize_parallel(ParallelConfig(tp=tp, cp=cp))
    set_megatron_args(*write_configs(tmp, CONFIG, ref.state_dict()), tp=tp, cp=cp)
    sora = pretrain_sora()
    with contextlib.redirect_stdout(io.StringIO()):
        model = sora["model_provider"]()
    drawn = record_q_sample(model)
    torch.manual_seed(7)  # the scheduler's draws: the same on every rank
    output, loss_func = sora["forward_step"](iter([feature_batch(CONFIG)]), model)
    loss = loss_func(output)[0] * cp  # what Megatron's schedule backpropagates
    loss.sum().backward()
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for p in model.predictor.parameters():  # Megatron DDP: the average over data x context parallel ranks
        dist.all_reduce(p.grad, group=group)
        p.grad /= group.size()
    return loss, drawn[0], model, gather_tp(model.predictor, "grad")


def _our_flow_loss(ref, drawn, adapters=None):
    """mm-grpo's flow-matching loss on the scheduler's draw, single-process model, times the
    scheduler's timestep weight (tests/test_mindspeed_mm_sora.py shows the single-process case).
    `adapters`: (LoRAConfig, whole adapters) of mm-grpo's LoRA on the model."""
    from mm_grpo.flow.matching import flow_matching_loss
    from mm_grpo.families.flux.transformer import FluxTransformer
    from mm_grpo.families.flux.transformer.hf_weights import load_hf_weights
    from mm_grpo.families.flux.transformer.latents import pack_latents, prepare_latent_image_ids
    from tests.sora_helpers import feature_batch
    batch = feature_batch(CONFIG)
    noised, noise, timestep = drawn
    initialize_parallel(ParallelConfig())
    ours = load_hf_weights(FluxTransformer(CONFIG), ref.state_dict())
    if adapters is not None:
        from mm_grpo.families.flux.transformer import lora
        lora.add_adapters(ours, adapters[0], seed=0)
        lora.copy_full_adapters(ours, adapters[1], adapters[0])
    t5, pooled = batch["prompt_ids"]
    v = ours(pack_latents(noised), t5, pooled, (timestep / 1000).expand(2), prepare_latent_image_ids(4, 4),
             torch.zeros(t5.shape[1], 3), guidance=torch.full((2,), 3.5))
    loss = flow_matching_loss(v, pack_latents(batch["video"]), pack_latents(noise)).mean()
    return loss, ours


def _sora_matches(tp=1, cp=1):
    ref = random_reference(CONFIG, seed=8)
    with tempfile.TemporaryDirectory() as tmp:
        loss, drawn, model, full = _sora_loss(tmp, ref, tp=tp, cp=cp)
    weight = model.diffusion._training_weight(drawn[2])
    ours_loss, ours = _our_flow_loss(ref, drawn)
    expected = weight * ours_loss
    expected.backward()
    ref_grads = dict(ours.named_parameters())
    grad_err = max(rel_err(g, ref_grads[name].grad) for name, g in full.items())
    return {"loss": loss.item(), "expected": expected.item(), "n_grads": len(full),
            "loss_err": _world_max(abs(loss.item() - expected.item()) / abs(expected.item())),
            "grad_err": _world_max(grad_err)}


@check(2)
def pretrain_sora_flow_step_tp2_matches_mm_grpo():
    return _sora_matches(tp=2)


@check(2)
def pretrain_sora_flow_step_cp2_matches_mm_grpo():
    return _sora_matches(cp=2)


@check(2)
def pretrain_sora_lora_tp2_matches_mm_grpo_lora():
    """MindSpeed-MM's own LoRA (--lora-target-modules: peft around the model, through its patched
    `get_model`) at TP2: whole random adapters sharded into peft's parameters by mm-grpo's adapter
    layout rules give the loss and the whole adapter gradients of mm-grpo's single-process LoRA.
    So peft shards adapters as those rules do (what lora_mm_to_hf reads them by)."""
    from megatron.training import training
    from mm_grpo.families.flux.transformer import lora
    from mm_grpo.families.flux.transformer import layout
    from tests.sora_helpers import (feature_batch, peft_adapters, pretrain_sora, record_q_sample, set_megatron_args,
                                    write_configs)
    config = lora.LoRAConfig(r=4, alpha=8.0)
    ref = random_reference(CONFIG, seed=8)
    tp = 2
    with tempfile.TemporaryDirectory() as tmp:
        initialize_parallel(ParallelConfig(tp=tp))
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        set_megatron_args(*write_configs(tmp, CONFIG, ref.state_dict()), tp=tp,
                          extra=("--lora-target-modules", *config.targets, "--lora-r", str(config.r),
                                 "--lora-alpha", str(int(config.alpha))))
        sora = pretrain_sora()
        with contextlib.redirect_stdout(io.StringIO()):
            wrapped = training.get_model(sora["model_provider"], wrap_with_ddp=False)[0]
    peft = peft_adapters(wrapped)
    full = random_adapters(types.SimpleNamespace(flux_config=CONFIG), config)  # the same on every rank
    with torch.no_grad():
        for base in lora.base_rules(CONFIG, config.targets):
            for rule, tensor in zip(lora.adapter_rules(base), full[base.hf[0]]):
                peft[rule.megatron].copy_(layout.shard(rule, tensor, tp_rank, tp, CONFIG))
    model = getattr(wrapped, "module", wrapped)
    drawn = record_q_sample(model)
    torch.manual_seed(7)  # the scheduler's draws: the same on every rank
    output, loss_func = sora["forward_step"](iter([feature_batch(CONFIG)]), wrapped)
    loss = loss_func(output)[0]
    loss.sum().backward()
    rules = [r for base in lora.base_rules(CONFIG, config.targets) for r in lora.adapter_rules(base)]
    grads = {r.megatron: _gather_whole(peft[r.megatron].grad, r, CONFIG) for r in rules}

    initialize_parallel(ParallelConfig())
    ours_loss, ours = _our_flow_loss(ref, drawn[0], adapters=(config, full))
    expected = model.diffusion._training_weight(drawn[0][2]) * ours_loss
    expected.backward()
    params = dict(ours.named_parameters())
    grad_err = max(rel_err(g, params[name].grad) for name, g in grads.items())
    return {"n_adapters": len(grads), "loss": loss.item(), "expected": expected.item(), "loss_err": _world_max(abs(loss.item() - expected.item()) / abs(expected.item())),
            "grad_err": _world_max(grad_err)}


def sora_pp2_flow_step_matches_mm_grpo():
    """pretrain_sora.py under pipeline parallelism: its model provider (the predictor's pipeline
    tensor shapes), forward step and MindSpeed's multi-tensor pipeline schedule, as MindSpeed-MM's
    `pretrain` drives them with --use-multiparameter-pipeline-model-parallel (which must be on
    this process's command line: tests/distributed/sora_pp_worker.py)."""
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from tests.sora_helpers import feature_batch, pretrain_sora, record_q_sample, set_megatron_args, write_configs
    ref = random_reference(CONFIG, seed=8)
    with tempfile.TemporaryDirectory() as tmp:
        initialize_parallel(ParallelConfig(pp=2))
        set_megatron_args(*write_configs(tmp, CONFIG, ref.state_dict(), predictor_extra={
            "pipeline_num_layers": [3, 5], "num_layers": 8, "text_len": 7}), pp=2,
            extra=("--use-multiparameter-pipeline-model-parallel",))
        sora = pretrain_sora()
        with contextlib.redirect_stdout(io.StringIO()):
            model = sora["model_provider"]()
    model.model_type = ModelType.encoder_or_decoder  # what Megatron's get_model sets on each chunk
    drawn = record_q_sample(model)
    torch.manual_seed(7)
    losses = get_forward_backward_func()(
        forward_step_func=sora["forward_step"], data_iterator=iter([feature_batch(CONFIG)]), model=[model],
        num_microbatches=1, seq_length=0, micro_batch_size=2, forward_only=False)
    # The first stage drew the noise; the last computed the loss: share both.
    shared = [drawn[0] if drawn else None, losses[0]["loss"].item() if losses else None]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shared)
    draw, loss = everyone[0][0], everyone[-1][1]
    grads = gather_tp(model.predictor, "grad")
    weight = model.diffusion._training_weight(draw[2])
    ours_loss, ours = _our_flow_loss(ref, draw)
    expected = weight * ours_loss
    expected.backward()
    return {"loss": loss, "expected": expected.item(),
            "loss_err": _world_max(abs(loss - expected.item()) / abs(expected.item())),
            "grad_err": _world_max(_stage_grad_err(model.predictor, grads, ours)),
            "n_grads": _world_sum(len(grads)), "min_grad_norm": -_world_max(-min(g.norm().item() for g in grads.values()))}


def _world_sum(value):
    t = torch.tensor(float(value), dtype=STAT_DTYPE)  # not float64: MindSpeed leaves that unreduced
    dist.all_reduce(t)
    return t.item()


def _stage_grad_err(stage, grads, ours):
    """Worst relative error of a pipeline stage's gradients against the single-process model's,
    matched through their diffusers names (stage blocks are numbered locally)."""
    from mm_grpo.families.flux.transformer import layout
    ref_rules = {r.hf: r.megatron for r in layout.stage_rules(ours.flux_config)}
    ref_params = dict(ours.named_parameters())
    rules = layout.stage_rules(stage.flux_config, stage.block_range, stage.pre_process, stage.post_process)
    return max(rel_err(grads[r.megatron], ref_params[ref_rules[r.hf]].grad) for r in rules)
