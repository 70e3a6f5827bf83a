"""sha256 of every checkpoint file we write, checked when it is read.

A shard `mp_rank_00/model_optim_rng.pt` gets `mp_rank_00/model_optim_rng.pt.sha256` beside it
(`sha256sum -c` reads it: "<hex>  <name>"), written after the shard is on disk. The iteration
folder itself holds only shard folders (MindSpeed-MM's `load_from_mm` opens each entry as one),
so the checksums live inside them. Reading a file whose checksum file exists verifies it first,
once per process and file version; a file without one (written by Megatron or MindSpeed-MM) is
read as it is. `set_verify(False)` (--no-verify) reads without checking.
"""
import hashlib
import os

SUFFIX = ".sha256"
BLOCK = 16 << 20
LINE_BYTES = 4096  # a checksum file's line: "<64 hex>  <name>"; what is read of it
_verify = True
_verified = set()  # (path, size, mtime_ns) checked in this process


class CorruptFile(ValueError):
    """A checkpoint file that is not what was written: truncated, changed since, or not a checkpoint.

    `reason` reads after the file's name ("does not match its checksum..."), for a line that names
    the iteration folder once (mm_grpo/checkpoint/resume.py); str() is the file's own one line."""

    def __init__(self, path: str, reason: str, line: str):
        super().__init__(line)
        self.path, self.reason = path, reason


def set_verify(enabled: bool):
    """Process-wide: whether reads check checksums (the trainers' and mm-convert's --no-verify)."""
    global _verify
    _verify = bool(enabled)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checksum(path: str):
    """`<path>.sha256` for the (complete, synced) file `path`, itself synced."""
    with open(path + SUFFIX, "w") as f:
        f.write(f"{sha256_of(path)}  {os.path.basename(path)}\n")
        f.flush()
        os.fsync(f.fileno())


def verify(path: str):
    """Raise CorruptFile naming `path` when it does not match its checksum file (if it has one)."""
    if not _verify or not os.path.isfile(path + SUFFIX):
        return
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key in _verified:
        return
    with open(path + SUFFIX, "rb") as f:  # bytes: a damaged checksum file is a mismatch, not a decode error
        expected = (f.read(LINE_BYTES).split() or [b""])[0].decode("ascii", "replace")
    actual = sha256_of(path)
    if actual != expected:
        reason = (f"does not match its checksum ({os.path.basename(path)}{SUFFIX}: sha256 {expected[:16]}..., "
                  f"the file: {actual[:16]}...): changed or corrupted after it was written")
        raise CorruptFile(path, reason, f"{path} {reason}; restore it, or read it anyway with --no-verify")
    _verified.add(key)
