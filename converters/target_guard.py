"""Where a conversion may write: never into its source or around it, never over a training run.

`resplit` into the source's own `iter_*` folder with --cfg.overwrite would replace a training
iteration (optimizer state included), and a target that holds the source would delete it; so a
target inside the source or containing it is refused, overwrite or not. A folder that training
wrote (an `iter_*` folder, a numbered tracker, a run folder's lock) is never a target: the
converter writes only `release` checkpoints and diffusers folders. Temporary folders that
crashed conversions of this target left (`.<target>.tmp-<host>:<pid>-*` of a process that is
gone) are removed first.
"""
import os
import re

from mm_grpo.checkpoint.paths import TRACKER_FILE, TRACKER_MAX_BYTES
from mm_grpo.files.atomic import remove_stale_temps
from mm_grpo.files.lock import LOCK_FILE

ITERATION = re.compile(r"iter_\d{7}")


def _training_folder(path: str):
    """Why `path` is a folder written by training (or None)."""
    if not os.path.isdir(path):
        return None
    if ITERATION.fullmatch(os.path.basename(os.path.normpath(path))):
        return "it is a training iteration folder"
    entries = os.listdir(path)
    if any(ITERATION.fullmatch(n) for n in entries):
        return "it holds training iterations (iter_*)"
    if LOCK_FILE in entries:
        return f"it is a training run folder ({LOCK_FILE})"
    tracker = os.path.join(path, TRACKER_FILE)
    if os.path.isfile(tracker):
        with open(tracker, "rb") as f:  # bytes: any content, text or not, is only compared here
            if f.read(TRACKER_MAX_BYTES).strip().isdigit():
                return f"its {TRACKER_FILE} points at a training iteration"
    return None


def check_target(source: str, target: str, in_place_ok: bool = False):
    """Refuse (ValueError, one line) a target inside / containing the source or written by training;
    `in_place_ok`: the target may be the source itself (hf_to_mm writes beside diffusers files)."""
    src, dst = os.path.realpath(source), os.path.realpath(target)
    if src == dst and in_place_ok:
        return
    if src == dst:
        raise ValueError(f"target_path {target} is the source; write to another folder")
    if dst.startswith(src.rstrip(os.sep) + os.sep):
        raise ValueError(f"target_path {target} is inside the source {source}: writing it would change the "
                         "checkpoint being read; write to a folder outside it")
    if src.startswith(dst.rstrip(os.sep) + os.sep):
        raise ValueError(f"target_path {target} contains the source {source}: replacing it would delete the "
                         "source; write to a folder outside it")
    why = _training_folder(dst)
    if why:
        raise ValueError(f"target_path {target} is not the converter's to replace: {why}; write to a new folder")


def prepare_target(source: str, target: str, in_place_ok: bool = False):
    """`check_target`, then remove what crashed conversions to `target` left beside it."""
    check_target(source, target, in_place_ok)
    dst = os.path.abspath(target)
    remove_stale_temps(os.path.dirname(dst), os.path.basename(dst))
    if in_place_ok and os.path.isdir(dst):
        remove_stale_temps(dst, "entries")
