"""Training checkpoints in the converter's layout, and resuming from them.

    <save>/iter_0000100/mp_rank_XX[_YYY]/model_optim_rng.pt
        {model | model0, model1..., optimizer, opt_param_scheduler, rng_state, iteration,
         consumed_prompts, checkpoint_version}
    <save>/iter_0000100/mp_rank_XX[_YYY]/distrib_optim_dpNNN.pt  (--use-distributed-optimizer)
    <save>/latest_checkpointed_iteration.txt                  written last, atomically

The data-parallel (and context-parallel) rank 0 of every TP x PP position writes its shard;
all shards go to a temporary folder that is renamed once every rank is done.

Resuming: `check_resume` picks the iteration (--ckpt-step, else the tracker's) and checks that it
is intact before anything heavy (mm_grpo/checkpoint/resume.py); a file found damaged while loading
(its checksum) stops every rank with the same one line, naming the newest intact iteration.

The model family's part is handed in as `weights` (FLUX's: mm_grpo/families/flux/checkpoint/
weights.py): `weights.state_dict(chunk)`, what a chunk saves, and `weights.load(chunks, folder)`,
loading this rank's chunks from any layout and returning the checkpoint's metadata (its `tp_size`,
`pp_size`, `vpp_size`, `shard_name`); `meta` is the family's metadata the writer stores.
"""
import os
import random

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mm_grpo.checkpoint import checksum
from mm_grpo.checkpoint.metadata import shard_extras
from mm_grpo.checkpoint.paths import RELEASE, SHARD_FILE, iteration_dir, model_key
from mm_grpo.checkpoint.resume import check_train_iters, resume_point, unreadable
from mm_grpo.checkpoint.shard_io import ShardReader, load_file, save_file
from mm_grpo.checkpoint.writer import CheckpointWriter, clear_stale
from mm_grpo.training.optim import unwrap
from mm_grpo.training.run_guard import guarded_save


def _rng_state():
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
             "python_version": random.getstate()[0], "python_gauss": random.getstate()[2]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _distributed(optimizer):
    return getattr(optimizer.config, "use_distributed_optimizer", False)


def _distrib_optim_file(shard_dir):
    """This data-parallel rank's part of the distributed optimizer's state.

    megatron-core 0.16.1's `save_parameter_state` / `load_parameter_state` (gather to DP
    rank 0 and scatter back) fail with the torch AdamW it falls back to without Apex or
    Transformer Engine, so each DP rank saves its own shard: resuming needs the same DP size."""
    return os.path.join(shard_dir, f"distrib_optim_dp{parallel_state.get_data_parallel_rank():03d}.pt")


def _writes_shard():
    return (parallel_state.get_data_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0)


def save_checkpoint(root, iteration, model_chunks, optimizer, scheduler, meta, weights, extra: dict):
    """Collective: every rank calls it. `model_chunks` are this rank's (DDP-wrapped) chunks."""
    if dist.get_rank() == 0:
        clear_stale(root, iteration)
    dist.barrier()
    writer = CheckpointWriter(root, meta, iteration)
    with guarded_save(writer.tmp, f"saving iteration {iteration}"):  # a full disk: no partial folder left
        _write_shards(writer, model_chunks, optimizer, scheduler, weights, extra)
    dist.barrier()
    with guarded_save(writer.tmp, f"saving iteration {iteration}"):
        if dist.get_rank() == 0:
            writer.commit()


def _write_shards(writer, model_chunks, optimizer, scheduler, weights, extra):
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    shard_dir = os.path.dirname(writer.shard_path(tp_rank, pp_rank))
    if _distributed(optimizer):  # every DP rank keeps its own shard of Adam's state
        os.makedirs(shard_dir, exist_ok=True)
        save_file(optimizer.optimizer.state_dict(), _distrib_optim_file(shard_dir))
    if _writes_shard():
        tree = {model_key(v, len(model_chunks)): weights.state_dict(c) for v, c in enumerate(unwrap(model_chunks))}
        tree.update(optimizer=optimizer.state_dict(), opt_param_scheduler=scheduler.state_dict(),
                    rng_state=_rng_state(), **extra)
        writer.write_shard(tp_rank, pp_rank, tree)


def check_resume(args):
    """Before anything heavy, alike on every process: the iteration `--load` (`--ckpt-step`) resumes is
    intact and before --train-iters (ResumeRefused, one line, otherwise); `args.load` is pinned to its
    folder, so that the run loads the iteration checked. A run whose checkpoint is at --train-iters
    says so in one line (it trains nothing)."""
    point = resume_point(args.load, args.ckpt_step)
    if point is None:
        return
    notice = check_train_iters(point, args.train_iters)
    if notice and os.environ.get("RANK", "0") == "0":  # before the process group: torchrun's rank
        print(notice, flush=True)
    args.load = point.folder


def _agreed_damage(why):
    """Collective: the first rank's description of a damaged file (None when no rank found one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return why
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, why)
    return next((w for w in found if w is not None), None)


def load_checkpoint(path, model_chunks, weights, optimizer=None, scheduler=None, load_optim=True, load_rng=True):
    """Load weights (any TP/PP) and, for an `iter_*` checkpoint of this layout, the training state.
    Collective: a file of the checkpoint found damaged on any rank (its checksum) stops every rank
    with the same ResumeRefused line.

    Returns (iteration, extra) where extra holds e.g. `consumed_prompts`; a `release` checkpoint
    (from the converter) gives iteration 0 and no extra state."""
    folder = iteration_dir(path)
    why, loaded = None, None
    try:
        loaded = _load(folder, model_chunks, weights, optimizer, scheduler, load_optim, load_rng)
    except checksum.CorruptFile as e:
        why = f"{os.path.relpath(e.path, folder)} {e.reason}"
    why = _agreed_damage(why)
    if why is not None:
        raise unreadable(folder, why)
    return loaded


def _load(folder, model_chunks, weights, optimizer, scheduler, load_optim, load_rng):
    meta = weights.load(unwrap(model_chunks), folder)
    if os.path.basename(folder) == RELEASE:
        return 0, {}
    same_layout = (meta.tp_size, meta.pp_size, meta.vpp_size) == (
        parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
        len(model_chunks))
    if not same_layout and load_optim:
        raise ValueError(f"{folder} was saved with TP={meta.tp_size} PP={meta.pp_size} VPP={meta.vpp_size}; "
                         "optimizer state only resumes on the same layout (use --no-load-optim, or resplit)")
    # On another layout this rank's shard may not exist: the iteration and extras are in every
    # shard, so read the first; per-rank RNG states do not carry over.
    ranks = ((parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
             if same_layout else (0, 0))
    load_rng = load_rng and same_layout
    shard = os.path.join(folder, meta.shard_name(*ranks))
    reader = ShardReader(os.path.join(shard, SHARD_FILE))
    try:
        state = shard_extras(reader)
    finally:
        reader.close()
    if load_optim and optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
        if _distributed(optimizer):
            path = _distrib_optim_file(shard)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} missing: the checkpoint was saved with another data-parallel "
                                        "size or without --use-distributed-optimizer (use --no-load-optim)")
            optimizer.optimizer.load_state_dict(load_file(path))
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if load_rng:
        _set_rng_state(state["rng_state"])
    extra = {k: v for k, v in state.items()
             if k not in ("optimizer", "opt_param_scheduler", "rng_state", "checkpoint_version")}
    return int(state["iteration"]), extra
