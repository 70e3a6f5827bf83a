"""Megatron's exits for preempted and time-limited jobs, in mm-grpo's training loop (loop.py).

- `--exit-signal-handler`: SIGTERM or SIGINT only records that it came; after each iteration every
  rank learns whether any rank got one, and then all save that iteration and exit 0. A signal during a
  save or an evaluation therefore never interrupts it, and a second signal changes nothing (torchrun
  forwards the one it gets, so a worker may receive the same stop twice).
- `--exit-duration-in-mins`: after each iteration every rank checks whether the elapsed time since its
  process started, plus the longest iteration so far (its evaluation and save included), plus the last
  save's duration would pass the limit; if any would, all save and exit 0, so that the job is saved and
  gone before a scheduler's wall-clock limit. Megatron instead stops once the limit has passed.

Each check costs one two-element all-reduce per iteration, only when one of the flags is given.
"""
import dataclasses
import signal
import threading
import time
from typing import Optional

import psutil
import torch
import torch.distributed as dist

from mm_grpo.training.entry import UsageError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SECONDS_PER_MINUTE = 60


def check_exit_args(args) -> None:
    """The exits save the last iteration: they need --save (one line, the same on every process)."""
    given = [flag for flag, value in (("--exit-signal-handler", args.exit_signal_handler),
                                      ("--exit-duration-in-mins", args.exit_duration_in_mins)) if value]
    if given and not args.save:
        raise UsageError(f"{' and '.join(given)} needs --save: the run saves its last iteration before it exits")


def process_start() -> float:
    """When this process started (epoch seconds): a scheduler counts the job's time from its start."""
    return psutil.Process().create_time()


@dataclasses.dataclass(frozen=True)
class Stop:
    """Why the run stops early: a signal's name, or the duration limit reached."""
    signal_name: Optional[str]
    elapsed_s: float
    margin_s: float  # what the next iteration and a save could take

    def describe(self, limit_minutes) -> str:
        if self.signal_name:
            return f"{self.signal_name} received (--exit-signal-handler)"
        return (f"--exit-duration-in-mins {limit_minutes:g}: {self.elapsed_s / SECONDS_PER_MINUTE:.1f} minutes "
                f"elapsed, and the next iteration and a save could take {self.margin_s / SECONDS_PER_MINUTE:.1f} more")


class ExitGuard:
    """`with ExitGuard(...) as guard:` around the loop installs the signal handlers (main thread only)
    and restores the previous ones after; `guard.check(iteration_s)` after each iteration (collective
    when a flag is given) returns a Stop or None; `guard.saved(seconds)` records a save's duration."""

    def __init__(self, exit_signal_handler: bool, exit_duration_in_mins: Optional[float], device,
                 clock=time.time, started: Optional[float] = None):
        self.handles_signals = bool(exit_signal_handler)
        self.limit_s = exit_duration_in_mins * SECONDS_PER_MINUTE if exit_duration_in_mins else None
        self.device, self.clock = device, clock
        self.started = process_start() if started is None else started  # Megatron: its module's import
        self.received = 0  # the first stop signal's number
        self.longest_iteration_s = self.last_save_s = 0.0
        self._previous = {}

    @classmethod
    def from_args(cls, args, device):
        return cls(args.exit_signal_handler, args.exit_duration_in_mins, device)

    @property
    def active(self) -> bool:
        return self.handles_signals or self.limit_s is not None

    def __enter__(self):
        if self.handles_signals and threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._record) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _record(self, signum, frame):
        # nothing else here: printing from a handler can re-enter a print in progress
        self.received = self.received or signum

    def saved(self, seconds: float) -> None:
        self.last_save_s = seconds

    def check(self, iteration_s: float) -> Optional[Stop]:
        if not self.active:
            return None
        self.longest_iteration_s = max(self.longest_iteration_s, iteration_s)
        elapsed = self.clock() - self.started
        margin = self.longest_iteration_s + self.last_save_s
        late = self.limit_s is not None and elapsed + margin > self.limit_s
        agreed = torch.tensor([self.received, int(late)], dtype=torch.int32, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        signum, late = agreed.tolist()
        if not (signum or late):
            return None
        return Stop(signal.Signals(signum).name if signum else None, elapsed, margin)
