"""The one training loop and the one optimizer step of mm-grpo's trainers (GRPO and flow matching).

`optimizer_step` is Megatron's `train_step` on a list of micro-batches: zero the gradient
buffers, megatron-core's forward-backward over all micro-batches (gradients accumulated), a
finite check agreed by all ranks, the optimizer step, the LR-scheduler step. MindSpeed-MM's
`pretrain` runs its own `train_step` on the same micro-batches and loss
(`mm_grpo/mindspeed_mm/grpo.py`).

`TrainingRun.train` is the loop: iterations from the resumed one to --train-iters, each
`step(iteration)`, logged; held-out evaluation before training and every --eval-interval,
image grids every --save-image-interval, checkpoints every --save-interval and at the end
(never of a skipped iteration); --max-skipped-iterations skipped in a row stop the run. The save
folder is locked and probed before the first rollout (mm_grpo/training/run_guard.py).
--exit-signal-handler and --exit-duration-in-mins stop it early, the iteration just done saved
(mm_grpo/training/preemption.py). A checkpoint records the trainer's batch sizes, so that a resume
that changes them says so in one line.
"""
import json
import math
import os
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from mm_grpo.checkpoint import checksum
from mm_grpo.files.atomic import atomic_write_text
from mm_grpo.parallel.state import dp_mean
from mm_grpo.training import run_guard
from mm_grpo.training.checkpointing import load_checkpoint, save_checkpoint
from mm_grpo.training.logging_utils import TrainLogger, is_logging_rank
from mm_grpo.training.preemption import ExitGuard, check_exit_args

BATCH_SIZES_KEY = "batch_sizes"  # a checkpoint's {flag: value} of TrainingRun.batch_sizes()


def all_finite(loss: float, ddp_chunks) -> bool:
    """The loss and every gradient finite, agreed by all ranks (the optimizer step is collective,
    so either every rank steps or none does). The flag lives on the parameters' device:
    NCCL / HCCL reduce accelerator tensors only. One host sync: the gradients' largest magnitudes
    (one multi-tensor kernel: inf or NaN exactly where a gradient is not finite, and no overflow
    of a sum) are checked together on the device, and only the agreed flag is read back."""
    grads = [getattr(p, "main_grad", p.grad) for chunk in ddp_chunks for p in chunk.parameters() if p.requires_grad]
    largest = torch._foreach_norm(grads, math.inf)
    flag = torch.stack([m.float() for m in largest]).isfinite().all().float()
    if not math.isfinite(loss):
        flag.zero_()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def optimizer_step(chunks, optimizer, scheduler, micro_batches: Sequence[Dict], loss_fn, *,
                   forward_backward: Callable) -> Tuple[List[Dict], Dict[str, float]]:
    """One optimizer step of this rank's DDP model `chunks` over its `micro_batches`.

    loss_fn(output, micro_batch) -> (loss, stats) runs on the last pipeline stage;
    forward_backward(chunks, micro_batches, loss_fn) -> [{"loss": ..., **stats}] is the model family's
    forward and backward under megatron-core's schedule (FLUX's: families/flux/chunks.py). Returns the
    per-micro-batch results of `forward_backward` and the step's stats: loss (averaged over
    micro-batches and data-parallel ranks), grad_norm, skipped, lr. A non-finite loss or gradient
    on any rank skips the step on every rank."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    per_mb = forward_backward(chunks, micro_batches, loss_fn)
    loss = dp_mean(torch.stack([m["loss"].float() for m in per_mb]).mean())
    if not all_finite(loss, chunks):
        return per_mb, {"loss": loss, "skipped": 1.0, "grad_norm": float("nan"),
                        "skip_reason": "non-finite loss or gradient"}
    ok, grad_norm, _ = optimizer.step()
    if ok:
        scheduler.step(increment=1)
    return per_mb, {"loss": loss, "grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
                    "skipped": 0.0 if ok else 1.0, "lr": optimizer.param_groups[0]["lr"]}


def write_eval_scores(path: str, iteration: int, result) -> None:
    """An evaluation's per-sample scores, {"iteration", "prompts", "noises", "scores": {name: [prompt][noise]}},
    so that runs can be compared or pooled afterwards on the same (prompt, noise) cells."""
    noises = result.samples_per_prompt
    tables = result.tables()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_text(path, json.dumps({"iteration": iteration, "prompts": result.prompts[::noises], "noises": noises,
                                        "scores": {k: v.tolist() for k, v in tables.items()}}))


class TrainingRun:
    """What a trainer defines for the loop: `args`, `model` (a `Trainable`), `settings` (with
    `samples_per_iteration`), `evaluator` (or None), `step(iteration) -> stats`; optionally
    `checkpoint_extras()` and `finish()`. `resume()` after building loads a training checkpoint."""

    def __init__(self, args):
        self.args = args
        check_exit_args(args)
        checksum.set_verify(not args.no_verify)  # before any checkpoint is read
        self.start_iteration = 0
        self.evaluations = {}  # iteration -> held-out stats, across resumes (checkpointed)
        self.first_eval = self.last_eval = None  # this run's first and last EvalResult
        self.stopped = None  # the preemption.Stop that ended the run early

    def step(self, iteration: int) -> Dict:
        raise NotImplementedError

    def batch_sizes(self) -> Dict[str, int]:
        """Flag -> value of the sizes that shape an iteration (recorded in each checkpoint)."""
        return {}

    def evaluated_policy(self):
        """The model chunks the held-out evaluation scores (the policy, or its EMA)."""
        return self.model.modules

    def checkpoint_extras(self) -> Dict:
        """What a checkpoint holds besides the model, optimizer, scheduler, RNG and iteration."""
        return {}

    def finish(self):
        """Called once after the last iteration (every rank)."""

    # --- the loop ---------------------------------------------------------------------
    def train(self) -> List[Dict]:
        args = self.args
        lock = run_guard.prepare_save_folder(args.save, run_guard.checkpoint_bytes(self.model.chunks)) \
            if args.save else None
        skips = run_guard.SkipGuard(args.max_skipped_iterations)
        exits = ExitGuard.from_args(args, next(self.model.chunks[0].parameters()).device)
        logger = TrainLogger(args.tensorboard_dir, args.train_iters, self.start_iteration,
                             progress_bar=not args.no_progress_bar, log_interval=args.log_interval)
        history = []
        save_due, skipped, saved = False, False, None
        try:
            with exits:
                if self.evaluator and args.eval_interval and self.start_iteration < args.train_iters:
                    self.evaluate(self.start_iteration, logger)  # before training
                for it in range(self.start_iteration, args.train_iters):
                    start = time.time()
                    stats = self.step(it)
                    stats["samples_per_second"] = self.settings.samples_per_iteration / (time.time() - start)
                    history.append(stats)
                    logger.log(it + 1, stats)
                    done = it + 1
                    skipped = skips.update(done, stats)
                    eval_due = bool(args.eval_interval) and (done % args.eval_interval == 0 or done == args.train_iters)
                    image_due = bool(args.save_image_interval) and done % args.save_image_interval == 0
                    if (eval_due or image_due) and self.evaluator:
                        result = self.evaluate(done, logger, log_stats=eval_due, save_images=image_due)
                        if eval_due:
                            stats.update(result.stats)
                    # A skipped iteration is not saved: the save waits for the next completed one.
                    save_due = save_due or bool(args.save and args.save_interval and done % args.save_interval == 0)
                    if save_due and not skipped:
                        self.timed_save(done, exits)
                        save_due, saved = False, done
                    self.stopped = exits.check(time.time() - start)
                    if self.stopped:
                        self.stop_early(done, skipped, saved, exits)
                        break
                ran = self.start_iteration < args.train_iters  # a resume past --train-iters trains nothing
                if args.save and ran and saved != args.train_iters and not self.stopped:
                    if skipped:
                        if dist.get_rank() == 0:
                            print(f"mm-grpo: warning: iteration {args.train_iters} was skipped: not saved, "
                                  f"{args.save} keeps its latest checkpoint", flush=True)
                    else:  # still under the handler: a stop signal now does not cut this save short
                        self.save(args.train_iters)
                if ran and not self.stopped:
                    self.finish()
        finally:
            logger.close()
            if lock is not None:
                lock.release()
        return history

    def timed_save(self, iteration, exits):
        start = time.time()
        self.save(iteration)
        exits.saved(time.time() - start)

    def stop_early(self, done, skipped, saved, exits):
        """The iteration just done saved (unless it was skipped, or saved already), said in one line."""
        args = self.args
        if skipped:
            kept = f"which was skipped: not saved, {args.save} keeps its latest checkpoint"
        else:
            if saved != done:
                self.timed_save(done, exits)
            kept = f"saved in {args.save}"
        if dist.get_rank() == 0:
            print(f"mm-grpo: {self.stopped.describe(args.exit_duration_in_mins)}: stopped after iteration {done} of "
                  f"{args.train_iters}, {kept}; resume with --load {args.save}", flush=True)

    # --- evaluation ---------------------------------------------------------------------
    def evaluate(self, iteration, logger=None, log_stats=True, save_images=False):
        """Held-out evaluation of the current policy, recorded in `evaluations` (iteration -> stats)
        and kept as `first_eval` / `last_eval` of this run. With a logger: its stats logged
        (`log_stats`) and / or its first 16 images saved as a grid."""
        result = self.evaluator(self.evaluated_policy())
        self.evaluations[iteration] = result.stats
        self.first_eval = self.first_eval or result
        self.last_eval = result
        if logger is not None and log_stats:
            logger.log_eval(iteration, result.stats)
        if logger is not None and save_images and self.image_dir:
            logger.image_grid(iteration, result.images[:16], os.path.join(self.image_dir, f"eval_{iteration:06d}.png"))
        if self.run_dir and is_logging_rank():
            write_eval_scores(os.path.join(self.run_dir, "eval", f"scores_{iteration:06d}.json"), iteration, result)
        return result

    @property
    def run_dir(self):
        return self.args.tensorboard_dir or self.args.save

    @property
    def image_dir(self):
        return os.path.join(self.run_dir, "samples") if self.run_dir else None

    # --- checkpoints ------------------------------------------------------------------
    def save(self, iteration):
        m = self.model
        lora = {"lora": m.lora} if m.lora else {}
        save_checkpoint(self.args.save, iteration, m.chunks, m.optimizer, m.scheduler, m.meta, m.weights,
                        {"iteration": iteration, "evaluations": self.evaluations, BATCH_SIZES_KEY: self.batch_sizes(),
                         **lora, **self.checkpoint_extras()})

    def resume(self) -> Dict:
        """Weights, optimizer, scheduler, RNG, iteration and evaluations from --load; the other extras."""
        m, args = self.model, self.args
        self.start_iteration, extra = load_checkpoint(args.load, m.chunks, m.weights, m.optimizer, m.scheduler,
                                                      load_optim=not args.no_load_optim,
                                                      load_rng=not args.no_load_rng)
        self.evaluations = dict(extra.get("evaluations", {}))
        self.say_changed_sizes(extra.get(BATCH_SIZES_KEY) or {})
        return extra

    def say_changed_sizes(self, saved: Dict[str, int]):
        """One line when this run's batch sizes differ from those its checkpoint was saved with (a resume
        may change them on purpose; the iterations after it then differ from an uninterrupted run's)."""
        changed = {flag: value for flag, value in self.batch_sizes().items() if saved.get(flag, value) != value}
        if changed and dist.get_rank() == 0:
            print(f"mm-grpo: {self.args.load} (iteration {self.start_iteration}) was saved with "
                  + " ".join(f"{flag} {saved[flag]}" for flag in changed) + "; this run goes on with "
                  + " ".join(f"{flag} {value}" for flag, value in changed.items()), flush=True)
