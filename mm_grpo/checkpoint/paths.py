"""Names in Megatron's on-disk checkpoint layout (`--ckpt-format torch`).

    <root>/latest_checkpointed_iteration.txt     "release" or the iteration number
    <root>/release/ or <root>/iter_0000100/      one folder per saved iteration, holding nothing
                                                 but shard folders (MindSpeed-MM's `load_from_mm`
                                                 opens every entry as one)
        mp_rank_00/model_optim_rng.pt            PP = 1: one folder per TP rank
        mp_rank_00_000/model_optim_rng.pt        PP > 1: per TP rank and PP rank

mm-grpo's own metadata (model config + parallel layout) rides inside every shard file under
META_KEY, beside Megatron's `args`; both Megatron's `--load` and `load_from_mm` ignore it.
"""
import os
import re

from mm_grpo.files.atomic import atomic_write_text

TRACKER_FILE = "latest_checkpointed_iteration.txt"
SHARD_FILE = "model_optim_rng.pt"
META_KEY = "mm_grpo_layout"
EMA_KEY = "ema"  # a training shard's EMA of the policy (--ema-decay): one state dict per model chunk
RELEASE = "release"
CHECKPOINT_VERSION = 3.0  # what Megatron-LM writes into every shard
TRACKER_MAX_BYTES = 64  # "release" or a number, and a newline; more is not a tracker file
TRACKER_SHOWN_CHARS = 40  # of a tracker file's wrong text, in its error
SHARD_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")


def iteration_name(iteration=RELEASE) -> str:
    if iteration == RELEASE:
        return RELEASE
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise ValueError(f"iteration must be 'release' or a whole number >= 0, got {iteration!r}")
    return f"iter_{iteration:07d}"


def shard_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def model_key(vchunk: int, vpp_size: int) -> str:
    """Key of a model chunk's state dict in a shard: 'model', or 'model0', 'model1'... with VPP."""
    return "model" if vpp_size == 1 else f"model{vchunk}"


def shard_folders(folder: str) -> dict:
    """{(tp_rank, pp_rank): shard folder name} of the shards present in an iteration folder
    (folders named mp_rank_XX or mp_rank_XX_YYY that hold model_optim_rng.pt)."""
    found, kinds = {}, set()
    entries = os.listdir(folder) if os.path.isdir(folder) else []
    for name in entries:
        match = SHARD_DIR.fullmatch(name)
        if match and os.path.isfile(os.path.join(folder, name, SHARD_FILE)):
            found[(int(match[1]), int(match[2] or 0))] = name
            kinds.add(match[2] is None)
    if len(kinds) > 1:
        raise ValueError(f"{folder} mixes shard folders with and without a pipeline rank (mp_rank_XX and "
                         "mp_rank_XX_YYY): two checkpoints in one folder?")
    return found


def read_tracker(root: str) -> str:
    """The iteration folder name that `latest_checkpointed_iteration.txt` points at; a file that
    holds anything else is refused in one line naming it."""
    path = os.path.join(root, TRACKER_FILE)
    with open(path, "rb") as f:  # bytes: a damaged tracker is named, not a bare decode error
        raw = f.read(TRACKER_MAX_BYTES + 1)
    expected = f'it should hold "{RELEASE}" or an iteration number'
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not text: byte {e.start} is {raw[e.start:e.start + 1]!r}; {expected}") from None
    if text == RELEASE:
        return RELEASE
    if len(raw) > TRACKER_MAX_BYTES or not (text.isascii() and text.isdigit()):
        shown = text if len(text) <= TRACKER_SHOWN_CHARS else text[:TRACKER_SHOWN_CHARS] + "..."
        raise ValueError(f"{path} holds {shown!r}; {expected}")
    return iteration_name(int(text))


def write_tracker(root: str, iteration=RELEASE):
    atomic_write_text(os.path.join(root, TRACKER_FILE), str(iteration))


def is_megatron_checkpoint(path: str) -> bool:
    """A checkpoint root (has the tracker file) or one iteration folder of it (has shard folders)."""
    return os.path.isfile(os.path.join(path, TRACKER_FILE)) or bool(shard_folders(path))


def iteration_dir(path: str, iteration=None) -> str:
    """The iteration folder to read: `path` itself if it is one, else `iteration` or the tracker's."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such Megatron checkpoint: {path}")
    if not os.path.isfile(os.path.join(path, TRACKER_FILE)) and shard_folders(path):
        return path
    if iteration is not None:
        folder = os.path.join(path, iteration_name(iteration))
    elif os.path.isfile(os.path.join(path, TRACKER_FILE)):
        folder = os.path.join(path, read_tracker(path))
    else:
        raise FileNotFoundError(f"{path} is not a Megatron checkpoint: it has no {TRACKER_FILE}")
    if not shard_folders(folder):
        raise FileNotFoundError(f"{folder} holds no mp_rank_*/{SHARD_FILE}: not a Megatron checkpoint, or incomplete")
    return folder
