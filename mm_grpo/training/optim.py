"""megatron-core DDP, optimizer and LR schedule for the model chunks of this rank."""
import math

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def wrap_ddp(model_chunks, use_distributed_optimizer=False):
    """DDP over the data-parallel (x context-parallel) group; gradients reduced in fp32.

    Also wires the hooks megatron-core's pipeline schedules call: no_sync for gradient
    accumulation and finalize_model_grads (DP/CP all-reduce, pipeline-tied weights)."""
    tconfig = model_chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer, check_for_nan_in_grad=False)
    chunks = [DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=chunk,
                                      disable_bucketing=i > 0)
              for i, chunk in enumerate(model_chunks)]
    tconfig.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    tconfig.finalize_model_grads_func = finalize_model_grads
    return chunks


def build_optimizer(ddp_chunks, args):
    """AdamW with fp32 master weights (the model computes in bf16 under autocast with --bf16)."""
    config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, use_distributed_optimizer=args.use_distributed_optimizer,
        bf16=False, fp16=False)
    return get_megatron_optimizer(config, ddp_chunks)


def build_scheduler(optimizer, args):
    decay_iters = args.lr_decay_iters or args.train_iters
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=max(decay_iters, args.lr_warmup_iters + 1),
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=decay_iters, wd_incr_style="constant")


def all_finite(loss: float, ddp_chunks) -> bool:
    """The loss and every gradient finite, agreed by all ranks (the optimizer step is collective,
    so either every rank steps or none does). The flag lives on the parameters' device:
    NCCL / HCCL reduce accelerator tensors only."""
    params = [p for chunk in ddp_chunks for p in chunk.parameters() if p.requires_grad]
    finite = math.isfinite(loss) and all(bool(torch.isfinite(getattr(p, "main_grad", p.grad)).all()) for p in params)
    flag = torch.tensor(1.0 if finite else 0.0, device=params[0].device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
