"""Which iteration of a `--load` folder a run resumes, whether it is intact, and what to do when not.

An iteration folder is *intact* when what can be told without reading the weights holds:
- every shard the layout names is there (the metadata stored in the first shard, else, for a
  checkpoint written by Megatron or MindSpeed-MM, a shard grid without gaps that agrees with
  Megatron's saved args);
- every file (`model_optim_rng.pt`, `distrib_optim_dp*.pt`) is a whole zip: its directory, at
  its end, is there and no record runs past the end of the file (a truncated copy or save);
- every file has its sha256 file where the others have one (mm-grpo writes one beside each:
  mm_grpo/checkpoint/checksum.py; Megatron and MindSpeed-MM write none);
- every shard's pickle loads with weights_only=True and names nothing a checkpoint never holds.
The weights' bytes are not hashed here (that would read the whole checkpoint on every process):
the first shard, which every process reads anyway, is checked against its sha256 file before
the model is built, and every other file when it is loaded; a mismatch is reported the same way.

A folder that is not intact is named once, with the newest intact iteration beside it and the
flag that resumes that one (`--ckpt-step N`, Megatron's checkpoint step).
"""
import dataclasses
import os
import re
from typing import List, Optional

from mm_grpo.checkpoint import checksum
from mm_grpo.checkpoint.metadata import check_shard_set
from mm_grpo.checkpoint.paths import RELEASE, SHARD_FILE, TRACKER_FILE, iteration_name, read_tracker, shard_folders
from mm_grpo.checkpoint.shard_io import ShardReader, zip_damage

ITERATION_DIR = re.compile(r"iter_(\d{7})")
CHECKPOINT_FILE = re.compile(r"model_optim_rng\.pt|distrib_optim_dp\d+\.pt")  # what a shard folder holds
SHOWN_ITERATIONS = 8  # the newest ones, in a line that lists what a folder holds


class ResumeRefused(ValueError):
    """The iteration to resume is unreadable, missing, or not before --train-iters. Computed from the
    command line and the files alone: the same on every process (its line is printed once)."""


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    folder: str  # the iteration folder read
    iteration: int


def iterations(root: str) -> List[int]:
    """The iterations saved in a checkpoint folder (its `iter_NNNNNNN` folders), oldest first."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(m[1]) for m in map(ITERATION_DIR.fullmatch, names)
                  if m and os.path.isdir(os.path.join(root, m[0])))


def _checkpoint_files(folder: str, found: dict) -> List[str]:
    return [os.path.join(folder, name, entry) for name in sorted(found.values())
            for entry in sorted(os.listdir(os.path.join(folder, name))) if CHECKPOINT_FILE.fullmatch(entry)]


def damage(folder: str) -> Optional[str]:
    """Why the iteration folder `folder` cannot be resumed (module doc: what is checked), or None."""
    if not os.path.isdir(folder):
        return "it is missing"
    try:
        found = shard_folders(folder)
    except ValueError as e:
        return str(e)
    if not found:
        return f"it holds no mp_rank_*/{SHARD_FILE}"
    files = _checkpoint_files(folder, found)
    summed = [path for path in files if os.path.isfile(path + checksum.SUFFIX)]
    for path in files:
        if summed and path not in summed:
            return (f"{os.path.relpath(path, folder)} has no {checksum.SUFFIX} file, which the others have: "
                    "an incomplete copy?")
        problem = zip_damage(path)
        if problem:
            return f"{os.path.relpath(path, folder)} is truncated, or not a torch.save file: {problem}"
    readers = []
    try:
        for key in sorted(found):  # the pickles only, not the weights
            readers.append(ShardReader(os.path.join(folder, found[key], SHARD_FILE), verify=False))
        check_shard_set(folder, found, readers[0])
    except checksum.CorruptFile as e:
        return f"{os.path.relpath(e.path, folder)} {e.reason}"
    except (ValueError, OSError) as e:
        return " ".join(str(e).split())
    finally:
        for reader in readers:
            reader.close()
    return None


def newest_intact(root: str, besides=()) -> Optional[int]:
    """The newest iteration of `root` that is intact, other than those in `besides`."""
    for iteration in reversed(iterations(root)):
        if iteration not in besides and damage(os.path.join(root, iteration_name(iteration))) is None:
            return iteration
    return None


def way_out(root: str, besides=(), root_given: bool = True) -> str:
    """The end of a refusal's line: the iteration to resume instead, and the flags that do it
    (`root_given`: --load named `root`, not one of its iteration folders)."""
    good = newest_intact(root, besides)
    if good is None:
        return f"no other checkpoint in {root} is intact: restore it, or start afresh without --load"
    flags = f"--ckpt-step {good}" if root_given else f"--load {root} --ckpt-step {good}"
    return f"the newest intact checkpoint is iteration {good}: resume from it with {flags}"


def unreadable(folder: str, why: str, root_given: bool = True) -> ResumeRefused:
    """The refusal of the iteration folder `folder` (`why`: its first problem)."""
    root = os.path.dirname(os.path.abspath(folder))
    match = ITERATION_DIR.fullmatch(os.path.basename(os.path.normpath(folder)))
    besides = (int(match[1]),) if match else ()
    return ResumeRefused(f"{folder} is unreadable ({why}); {way_out(root, besides, root_given)}")


def _held(root: str) -> str:
    held = iterations(root)
    shown = ", ".join(map(str, held[-SHOWN_ITERATIONS:]))
    return f"it holds iterations {'..., ' if len(held) > SHOWN_ITERATIONS else ''}{shown}" if held else "it holds none"


def _tracked(load: str) -> Optional[str]:
    """The iteration folder name the tracker of `load` names (None without one); ResumeRefused naming
    the file, and the iteration to resume instead, when it holds anything else."""
    if not os.path.isfile(os.path.join(load, TRACKER_FILE)):
        return None
    try:
        return read_tracker(load)
    except (ValueError, OSError) as e:
        raise ResumeRefused(f"{e}; {way_out(load)}") from None


def requested_iteration(load: Optional[str], ckpt_step: Optional[int] = None) -> Optional[int]:
    """The iteration a run with `--load load [--ckpt-step N]` asks for, from the flag or the tracker
    (None: none, or "release"), before its folder is looked at."""
    if ckpt_step is not None or not load or not os.path.isdir(load):
        return ckpt_step
    name = _tracked(load)
    return None if name in (None, RELEASE) else int(ITERATION_DIR.fullmatch(name)[1])


def _chosen_folder(load: str, ckpt_step: Optional[int]) -> Optional[str]:
    """The iteration folder of `load` to resume: --ckpt-step's, else the tracker's; None when `load`
    is no training checkpoint (converted weights, a diffusers folder, nothing saved yet)."""
    tracker = os.path.join(load, TRACKER_FILE)
    if ckpt_step is not None:
        if not os.path.isfile(tracker) and shard_folders(load):
            raise ResumeRefused(f"--ckpt-step {ckpt_step}: --load {load} is one iteration folder; give the folder "
                                "that holds the iterations (and its latest_checkpointed_iteration.txt)")
        folder = os.path.join(load, iteration_name(ckpt_step))
        if not os.path.isdir(folder):
            raise ResumeRefused(f"--ckpt-step {ckpt_step}: {load} has no iteration {ckpt_step} ({_held(load)})")
        return folder
    if os.path.isfile(tracker):
        name = _tracked(load)
        return None if name == RELEASE else os.path.join(load, name)
    if shard_folders(load):  # one iteration folder given itself
        return load if ITERATION_DIR.fullmatch(os.path.basename(os.path.normpath(load))) else None
    if iterations(load):
        raise ResumeRefused(f"{load} holds iterations but no {TRACKER_FILE}; {way_out(load)}")
    return None


def resume_point(load: Optional[str], ckpt_step: Optional[int] = None) -> Optional[ResumePoint]:
    """The intact iteration a run with `--load load [--ckpt-step N]` resumes, or None when it resumes
    none; ResumeRefused (one line pointing at the newest intact iteration) otherwise."""
    if not load:
        if ckpt_step is not None:
            raise ResumeRefused(f"--ckpt-step {ckpt_step} needs --load: the checkpoint folder to resume")
        return None
    if not os.path.isdir(load):
        if ckpt_step is not None:
            raise ResumeRefused(f"--ckpt-step {ckpt_step}: --load {load} is not a checkpoint folder")
        return None  # the trainer says what it is (a missing folder, a fresh start into --save)
    folder = _chosen_folder(load, ckpt_step)
    if folder is None:
        return None
    root_given = folder != load
    why = damage(folder)
    if why is not None:
        raise unreadable(folder, why, root_given)
    first = os.path.join(folder, shard_folders(folder)[(0, 0)], SHARD_FILE)
    try:  # every process reads the first shard (metadata, LoRA entry): hashed once, here, for all
        checksum.verify(first)
    except checksum.CorruptFile as e:
        raise unreadable(folder, f"{os.path.relpath(first, folder)} {e.reason}", root_given) from None
    return ResumePoint(folder, int(ITERATION_DIR.fullmatch(os.path.basename(os.path.normpath(folder)))[1]))


def check_train_iters(point: ResumePoint, train_iters: int) -> Optional[str]:
    """ResumeRefused when --train-iters is below the checkpoint's iteration (a count from the start,
    read as one from the checkpoint?); the notice to print when they are equal (a finished run
    launched again: nothing to train, exit 0); None otherwise, and for --train-iters 0, which asks
    for no training (the benches load a checkpoint that way to evaluate it)."""
    if train_iters == 0:
        return None
    if train_iters < point.iteration:
        raise ResumeRefused(f"--train-iters {train_iters} is less than the checkpoint's iteration {point.iteration} "
                            f"({point.folder}): nothing to train; --train-iters counts from iteration 0: raise it, "
                            "or load an earlier iteration with --ckpt-step")
    if train_iters == point.iteration:
        return (f"mm-grpo: {point.folder} is iteration {point.iteration}, --train-iters {train_iters}: nothing to "
                "train (raise --train-iters to train on)")
    return None
