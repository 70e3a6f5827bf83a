"""megatron-core DDP, optimizer and LR schedule for the model chunks of this rank."""
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import get_attr_wrapped_model

from mm_grpo.settings import from_args


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


def unwrap(chunks):
    """The bare model chunks inside DDP (and any other wrapper that keeps the model in `.module`)."""
    return [get_attr_wrapped_model(c, "block_range", return_model_obj=True) for c in chunks]  # every family's model


def build_optimizer(ddp_chunks, args):
    """AdamW with fp32 master weights (with --bf16 the model computes in bf16, casting them for each call): the
    OptimizerConfig fields named like the arguments (--lr, --adam-beta1, --clip-grad...) come
    from them, as in Megatron-LM."""
    return get_megatron_optimizer(from_args(OptimizerConfig, args, optimizer="adam", bf16=False, fp16=False),
                                  ddp_chunks)


def build_scheduler(optimizer, args):
    decay_iters = args.lr_decay_iters or args.train_iters
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=max(decay_iters, args.lr_warmup_iters + 1),
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=decay_iters, wd_incr_style="constant")
