"""What every trainer's `python -m` entry does around its run: report on one rank, tear the
process group down, and turn errors into one line and an exit status: 2 for a bad
configuration, a missing or unusable file or a run folder locked by another job, 3 for a run
that had to stop (too many skipped iterations, a failed save, a collective that timed out)."""
import os
import sys
import time

import torch.distributed as dist

from mm_grpo.files.lock import RunFolderLocked
from mm_grpo.parallel.state import end_process_groups
from mm_grpo.training import run_guard


class UsageError(ValueError):
    """A command line refused as it stands (a flag that needs another): the same on every process, so
    `run_entry` prints it once per launch."""


# How long a process that leaves its error line to its launch's speaker waits before it exits.
QUIET_EXIT_GRACE_S = 10.0


def train_and_report(run, report):
    """`run.train()`; then `report(history, seconds)` on the last rank (it holds the loss of the
    last pipeline stage)."""
    start = time.time()
    history = run.train()
    if dist.get_rank() == dist.get_world_size() - 1 and history:
        report(history, time.time() - start)
    return history


def speaks_for_launch() -> bool:
    """Whether this process speaks for its launch: torchrun's local rank 0 (one torchrun per node),
    or a process not started by torchrun."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def refuse_once_per_launch(message: str, status: int = 2):
    """Ends the process with one line, printed by the launch's speaker only, as `run_entry` ends it for
    a refusal that is the same on every process (argparse's refusals: `arguments.OneLineParser`)."""
    _fail(message, status, quiet=not speaks_for_launch())


def _fail(message: str, status: int, hard: bool = False, quiet: bool = False):
    if quiet:  # the launch's speaker prints the same line; torchrun stops the others once one exits,
        time.sleep(QUIET_EXIT_GRACE_S)  # so let it exit first (its status is then the one reported)
        sys.exit(status)
    line = f"mm-grpo: error: {message}"
    print(line, file=sys.stderr, flush=True)
    if os.environ.get("MM_GRPO_ERROR_FILE"):  # the launch scripts show the first one last (shell/run_trainer.sh)
        with open(os.environ["MM_GRPO_ERROR_FILE"], "a") as f:
            f.write(f"{status}\t{' '.join(line.split())}\n")
    if hard:  # a collective is broken: tearing the process group down could wait on it again
        sys.stdout.flush()
        os._exit(status)
    sys.exit(status)


def run_entry(main, agreed=()):
    """Calls `main()` (under torchrun: dying with the launcher); the errors above end the process
    with one line naming the problem instead of a traceback on every rank. `agreed`: exception
    types that `main` raises alike on every rank (checks of the same command line and files, or
    agreed by a collective): their line is printed once per launch (`speaks_for_launch`), the
    other processes exit with the same status quietly (UsageError always is)."""
    agreed = (UsageError, *agreed)
    run_guard.die_with_launcher()
    try:
        main()
    except (ValueError, FileNotFoundError, RunFolderLocked) as e:
        _fail(str(e), 2, quiet=isinstance(e, agreed) and not speaks_for_launch())
    except run_guard.TrainingStopped as e:
        _fail(str(e), 3, quiet=isinstance(e, agreed) and not speaks_for_launch())
    except RuntimeError as e:
        timeout = run_guard.describe_timeout(e)
        if timeout is None:
            raise
        _fail(timeout, 3, hard=True)
    except OSError as e:  # unreadable, unwritable or full: the message names the file
        _fail(str(e), 2)
    if dist.is_initialized():
        dist.barrier()
        end_process_groups()
