"""What keeps a training job from doing harm on a flaky cluster.

- Workers die with their launcher (`die_with_launcher`): torch elastic starts each worker in a
  session of its own, so killing the launcher's process group would leave them training on.
- One job per save folder (`prepare_save_folder`: a lock file, see mm_grpo/files/lock.py),
  which is created, cleared of our crashed saves' temporary folders and probed before the
  first rollout, not after hours of work at the first save.
- A failed save removes its partial temporary folder and says which file and why (`guarded_save`).
- A run that cannot learn stops (`SkipGuard`), and a collective that times out says which
  (`describe_timeout`).
"""
import contextlib
import ctypes
import os
import shutil
import signal
import sys
import threading
import time
import traceback

import torch.distributed as dist

from mm_grpo.checkpoint.shard_io import naming
from mm_grpo.files.atomic import remove_stale_temps
from mm_grpo.files.lock import RunFolderLock, RunFolderLocked

PROBE_BYTES = 1 << 20  # enough to hit a full disk (and a file-size limit), too little to matter
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class TrainingStopped(RuntimeError):
    """The run cannot go on (too many skipped iterations, a failed save)."""


class UnusableSaveFolder(ValueError):
    """--save cannot be created or written (a configuration error: found before any work)."""


# --- workers die with their launcher -------------------------------------------------------
def die_with_launcher():
    """Under torchrun: this process gets SIGKILL when its parent (the launcher) dies. Linux's
    parent-death signal; elsewhere a thread that watches the parent's pid."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    armed = False
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if not armed:
        def watch():
            while os.getppid() == parent:
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()
    if os.getppid() != parent:  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


# --- collective agreement ------------------------------------------------------------------
def first_error(error):
    """Collective: the first rank's error message (or None when every rank passed None), so that
    all ranks stop together instead of waiting for the failed one at the next collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    for rank, e in enumerate(errors):
        if e is not None:
            return e if rank == dist.get_rank() else f"rank {rank}: {e}"
    return None


# --- the save folder -----------------------------------------------------------------------
def _probe(folder: str):
    path = os.path.join(folder, f".probe-{os.getpid()}")
    try:
        with naming(path), open(path, "wb") as f:
            f.write(bytes(PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    finally:
        if os.path.lexists(path):
            os.remove(path)


def prepare_save_folder(folder: str, checkpoint_bytes: int):
    """Collective, before the first rollout: rank 0 creates `folder`, locks it for this job and
    removes our stale temporary folders; every rank writes and removes a probe file (nodes may
    mount the folder differently); rank 0 warns in one line when the free space is below
    `checkpoint_bytes`. Returns the lock (rank 0) or None; raises UnusableSaveFolder / RunFolderLocked."""
    lock, error, locked = None, None, False
    if dist.get_rank() == 0:
        try:
            os.makedirs(folder, exist_ok=True)
            lock = RunFolderLock(folder).acquire()
            removed = remove_stale_temps(folder)
            if removed:
                print(f"mm-grpo: removed temporary folders of crashed saves in {folder}: {', '.join(removed)}",
                      flush=True)
        except RunFolderLocked as e:
            error, locked = str(e), True
        except OSError as e:
            error = f"cannot use --save {folder}: {e}"
    error = first_error(error)
    if error is None:
        try:
            _probe(folder)
        except OSError as e:
            error = f"cannot write to --save {folder}: {e}"
        error = first_error(error)
    if error is not None:
        if lock is not None:
            lock.release()
        raise (RunFolderLocked if locked else UnusableSaveFolder)(error)
    if dist.get_rank() == 0:
        free = shutil.disk_usage(folder).free
        if free < checkpoint_bytes:
            print(f"mm-grpo: warning: {folder} has {free / 2**30:.2f} GiB free, a checkpoint needs about "
                  f"{checkpoint_bytes / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    return lock


def checkpoint_bytes(chunks) -> int:
    """Collective: about what one checkpoint takes, over all ranks that write shards: each trained
    weight in its dtype plus fp32 master weights and Adam's two moments for a non-fp32 one, or the
    two moments for an fp32 one. Frozen weights are not saved (a LoRA run's base: mm-grpo's and
    MindSpeed-MM's LoRA checkpoints hold the adapters)."""
    import torch
    from megatron.core import parallel_state
    writes = parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_context_parallel_rank() == 0
    local = sum(p.numel() * (p.element_size() + (8 if p.dtype == torch.float32 else 12))
                for chunk in chunks for p in chunk.parameters() if p.requires_grad) if writes else 0
    total = torch.tensor(local, dtype=torch.int64)  # not float64: see mm_grpo.parallel.state.STAT_DTYPE
    if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        dist.all_reduce(total)
    elif dist.get_world_size() > 1:  # NCCL / HCCL: an accelerator tensor
        p = next(chunks[0].parameters())
        total = total.to(p.device)
        dist.all_reduce(total)
    return int(total.item())


@contextlib.contextmanager
def guarded_save(tmp_dir: str, what: str):
    """Collective: the block's OSError on any rank stops every rank with one line naming the file,
    after rank 0 removed the partial `tmp_dir`."""
    error = None
    try:
        yield
    except OSError as e:
        error = str(e)
    error = first_error(error)
    if error is not None:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise TrainingStopped(f"{what} failed, partial {tmp_dir} removed: {error}")


def fresh_start(load, save) -> bool:
    """--load names a run folder with nothing to resume yet (empty but for our lock and temporary
    folders, or missing when it is --save: the usual LOAD=$SAVE of a first start): the run starts
    from the model's own weights, said in one line."""
    if not load:
        return False
    if os.path.isdir(load):
        if any(not name.startswith(".") for name in os.listdir(load)):
            return False
    elif not (save and os.path.abspath(load) == os.path.abspath(save)):
        return False
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"mm-grpo: --load {load} holds no checkpoint yet: a fresh start from predictor.from_pretrained",
              flush=True)
    return True


# --- a run that cannot learn -----------------------------------------------------------------
class SkipGuard:
    """Counts skipped iterations in a row; `max_in_a_row` of them (0: never) stop the run."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0

    def update(self, iteration: int, stats: dict) -> bool:
        """Whether `iteration` (1-based, just done) was skipped; raises TrainingStopped at the limit."""
        skipped = stats.get("skipped", 0.0) >= 1.0
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if skipped and self.max_in_a_row and self.in_a_row >= self.max_in_a_row:
            raise TrainingStopped(f"{self.in_a_row} iterations in a row skipped (up to iteration {iteration}: "
                                  f"{stats.get('skip_reason', 'no optimizer step')}); stopping at "
                                  f"--max-skipped-iterations {self.max_in_a_row}, nothing saved since the last "
                                  "completed iteration")
        return skipped


# --- timeouts ---------------------------------------------------------------------------------
def describe_timeout(error: BaseException):
    """One line for a collective that timed out (which collective, called from where), or None
    when `error` is not a timeout."""
    text = str(error)
    if "timed out" not in text.lower() and "timeout" not in text.lower():
        return None
    collective, caller = None, None
    for frame, line in traceback.walk_tb(error.__traceback__):
        code = frame.f_code
        if code.co_filename.endswith("distributed_c10d.py") and not code.co_name.startswith("_") \
                and code.co_name != "wrapper":
            collective = collective or code.co_name
        elif f"{os.sep}mm_grpo{os.sep}" in code.co_filename:
            caller = f"{code.co_name} ({os.path.relpath(code.co_filename)}:{line})"
    if collective is None:  # not raised by a torch.distributed collective
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return (f"rank {rank}: collective {collective} timed out in {caller or '?'}; another rank stopped "
            f"or hung ({first_line})")
