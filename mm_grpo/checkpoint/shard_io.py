"""Streaming reads and writes of one shard file (`model_optim_rng.pt`, a `torch.save` zip).

Whole FLUX.1 at TP = PP = 1 is one 24 GB shard, so neither side may hold a shard in
memory. Writing uses torch's own two-pass path: `torch.save` under `skip_data` writes the
pickled tree and reserves each tensor's bytes (from FakeTensors: no memory), `torch.load`
with `map_location="meta"` reports where each tensor's bytes live, and the tensors are
then written there one at a time. Reading loads the tree on meta the same way and reads
one tensor's bytes when asked. The file is an ordinary `torch.save` file: `torch.load`
reads it (zip CRCs of the data records are not filled in; torch does not check them).

A tree is any nesting of dicts, lists and tuples whose leaves are tensors or plain
values; tensors are addressed by their key path, e.g. ("model", "x_embedder.weight").
A container that appears twice in a tree (one dict under two keys) is pickled once and
stays one object when loaded; its tensors are addressed by the first key path that reaches
them. Loading uses `weights_only=True`: our extras must be tensors, numbers, strings, None,
lists, tuples and dicts. Shards written by others (Megatron's `args`, MindSpeed-MM's config
objects, numpy RNG states) are read without importing or running their classes: each
pickled class becomes an `Opaque` stand-in holding the pickled state.
"""
import argparse
import contextlib
import errno
import os
import zipfile
from typing import Iterator, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mm_grpo.checkpoint import checksum

KeyPath = Tuple


def tensor_leaves(tree, path=(), _seen=None) -> Iterator[Tuple[KeyPath, torch.Tensor]]:
    """(key path, tensor) for every tensor in `tree`, depth first; a container reached twice is
    walked once."""
    seen = set() if _seen is None else _seen
    if isinstance(tree, torch.Tensor):
        yield path, tree
        return
    if not isinstance(tree, (dict, list, tuple)) or id(tree) in seen:
        return
    seen.add(id(tree))
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in items:
        yield from tensor_leaves(value, path + (key,), seen)


def map_tensors(tree, fn, _memo=None):
    """`tree` with every tensor replaced by fn(tensor) (containers rebuilt, same types; a
    container reached twice becomes one rebuilt container)."""
    memo = {} if _memo is None else _memo
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if not isinstance(tree, (dict, list, tuple)):
        return tree
    if id(tree) not in memo:
        if isinstance(tree, dict):
            memo[id(tree)] = type(tree)((k, map_tensors(v, fn, memo)) for k, v in tree.items())
        else:
            memo[id(tree)] = type(tree)(map_tensors(v, fn, memo) for v in tree)
    return memo[id(tree)]


def _at(tree, path: KeyPath):
    for key in path:
        tree = tree[key]
    return tree


class Opaque:
    """An object of a class that a shard names but this process does not import: the pickled
    constructor arguments (`_args`) and state (attributes, or `_state`), nothing executed."""

    def __init__(self, *args, **kwargs):
        self._args = args

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self._state = state


def _stand_in(qualified_name: str):
    if qualified_name == "argparse.Namespace":  # Megatron's `args`: a plain attribute bag
        return argparse.Namespace
    module, _, name = qualified_name.rpartition(".")
    return type(name, (Opaque,), {"__module__": module, "__qualname__": name})


# Modules whose names torch's weights-only unpickler refuses outright, stand-in or not (the
# operating system and the interpreter: os.system, posix.system, sys.modules...). No checkpoint
# names them: a pickle that does was crafted to run something.
_NEVER_IN_A_CHECKPOINT = tuple(getattr(torch._weights_only_unpickler, "_blocklisted_modules",
                                       ("sys", "os", "posix", "nt")))
ZIP_MAGIC = b"PK\x03\x04"  # a torch.save file is a zip archive (torch >= 1.6)


def zip_damage(path: str):
    """Why the torch.save zip `path` is cut short (its directory, at its end, is gone or points past
    it), without reading its records; None when whole or not a zip (an old torch.save file)."""
    with open(path, "rb") as f:
        if f.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
            return None
    size = os.path.getsize(path)
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError):
        return f"no zip directory at its end ({size} bytes)"
    for record in records:
        if record.header_offset + record.compress_size > size:
            return f"its record {record.filename} runs past its end ({size} bytes)"
    return None


def _torch_reason(error: Exception) -> str:
    """The specific line of a torch.load error (its weights-only advice and links dropped)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    specific = [line for line in lines if not line.startswith(("Weights only load failed", "Check the documentation"))]
    return f"{type(error).__name__}: {' '.join(specific or lines[:1])}"


def _refuse_foreign(path: str, foreign):
    for name in foreign:
        if name.split(".", 1)[0] in _NEVER_IN_A_CHECKPOINT:
            reason = (f"is refused: its pickle names {name}, which a checkpoint never holds (read with "
                      "weights_only=True: nothing ran)")
            raise checksum.CorruptFile(path, reason, f"{path}: refused: its pickle names {name}, which a checkpoint "
                                                     "never holds (loading with weights_only=True); the file is not a "
                                                     "checkpoint mm-grpo wrote")


def _truncated(path: str, detail: str):
    return checksum.CorruptFile(path, f"is truncated, or not a torch.save file: {detail}",
                                f"cannot read checkpoint shard {path} (truncated, or not a torch.save file?): {detail}")


def _foreign_globals(path: str) -> list:
    """What the pickle of `path` names beyond torch's default allow-list, read once the file is known
    whole; CorruptFile (one line) for a truncated file or a name no checkpoint holds."""
    damage = zip_damage(path)
    if damage:
        raise _truncated(path, damage)
    try:
        foreign = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # unpickling errors on a foreign file
        raise _truncated(path, _torch_reason(e)) from None
    _refuse_foreign(path, foreign)
    return foreign


def _load_meta(path: str):
    """The tree of `path` with meta tensors (`_foreign_globals` checked first). The other classes it
    names become `Opaque` stand-ins: never run."""
    foreign = _foreign_globals(path)
    try:
        with torch.serialization.safe_globals([(_stand_in(n), n) for n in foreign]):
            tree = torch.load(path, map_location="meta", weights_only=True)
            if any(getattr(t.untyped_storage(), "_checkpoint_offset", None) is None for _, t in tensor_leaves(tree)):
                # torch 2.7 records the byte offsets only when loading under FakeTensorMode (whose
                # storages report wrong sizes there): take the offsets from such a second load.
                with FakeTensorMode():
                    fake = torch.load(path, map_location="meta", weights_only=True)
                for (_, t), (_, f) in zip(tensor_leaves(tree), tensor_leaves(fake)):
                    t.untyped_storage()._checkpoint_offset = f.untyped_storage()._checkpoint_offset
        return tree
    except Exception as e:  # zip errors on a damaged file, unpickling errors on a foreign one
        raise _truncated(path, _torch_reason(e)) from None


@contextlib.contextmanager
def naming(path: str):
    """An OSError inside names `path` (a write to an open file does not say which file); torch's
    zip writer reports a failed write (full disk, file-size limit) as a RuntimeError: made an OSError."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = path
        raise
    except RuntimeError as e:
        if "write" not in str(e).lower():
            raise
        raise OSError(errno.EIO, f"write failed ({str(e).strip().splitlines()[0]})", path) from None


def _sync(f):
    f.flush()
    os.fsync(f.fileno())


def save_file(obj, path: str):
    """torch.save to `path`, on disk (fsync) with its checksum file before returning; errors name the file."""
    with naming(path):
        with open(path, "wb") as f:
            torch.save(obj, f)
            _sync(f)
        checksum.write_checksum(path)


def write_tensor_at(f, offset: int, tensor: torch.Tensor):
    """Write the bytes of `tensor` (row-major) at `offset` of the open binary file `f`."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    f.seek(offset)
    f.write(memoryview(data.numpy()))


class ShardWriter:
    """Writes one shard file: its tree now (tensors as shapes only), the tensors one by one."""

    def __init__(self, path: str, tree):
        self.path = path
        with FakeTensorMode():
            skeleton = map_tensors(tree, lambda t: torch.empty(t.shape, dtype=t.dtype))
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with naming(path), torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, path)
        self._pending = {}  # key path -> (byte offset, meta tensor)
        for key, meta in tensor_leaves(_load_meta(path)):
            self._pending[key] = (meta.untyped_storage()._checkpoint_offset, meta)
        self._file = open(path, "r+b")

    def write(self, key: KeyPath, tensor: torch.Tensor):
        if key not in self._pending:
            raise KeyError(f"{self.path}: no tensor {key} to write (or written twice)")
        offset, meta = self._pending[key]
        if tensor.shape != meta.shape or tensor.dtype != meta.dtype:
            raise ValueError(f"{self.path}: {key} is {tuple(tensor.shape)} {tensor.dtype}, "
                             f"the file reserves {tuple(meta.shape)} {meta.dtype}")
        with naming(self.path):
            write_tensor_at(self._file, offset, tensor)
        del self._pending[key]

    def write_all(self, tree):
        for key, tensor in tensor_leaves(tree):
            self.write(key, tensor)

    def close(self):
        """Flushed to disk (fsync) and closed; its checksum file written once it is complete."""
        with naming(self.path):
            try:
                _sync(self._file)
            finally:
                self._file.close()
        if self._pending:
            raise ValueError(f"{self.path}: {len(self._pending)} tensors were never written, e.g. "
                             f"{next(iter(self._pending))}")
        with naming(self.path + checksum.SUFFIX):
            checksum.write_checksum(self.path)


def write_shard(path: str, tree):
    """Write a tree of real tensors and plain values, one tensor in memory at a time."""
    writer = ShardWriter(path, tree)
    writer.write_all(tree)
    writer.close()


def load_file(path: str):
    """A whole torch.save file of tensors and plain values (a distributed optimizer's shard), checked
    as a shard is: whole, no pickle naming what a checkpoint never holds, its checksum."""
    _foreign_globals(path)
    checksum.verify(path)
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:
        raise _truncated(path, _torch_reason(e)) from None


class ShardReader:
    """A shard file's tree with meta tensors (`.tree`); `read` fetches one tensor's bytes.
    `verify=False`: its checksum is not checked here (the pickle alone was read so far)."""

    def __init__(self, path: str, verify: bool = True):
        self.path = path
        self.tree = _load_meta(path)  # a truncated file is named as such first
        if verify:
            checksum.verify(path)
        self._file = open(path, "rb")

    def get(self, *key):
        """The meta tensor (or plain value) at a key path, with a clear error if it is not there."""
        try:
            return _at(self.tree, key)
        except (KeyError, IndexError, TypeError):
            raise KeyError(f"{self.path} has no entry {'/'.join(map(str, key))}") from None

    def _read_storage(self, storage) -> torch.UntypedStorage:
        data = torch.empty(storage.nbytes(), dtype=torch.uint8)
        self._file.seek(storage._checkpoint_offset)
        if self._file.readinto(memoryview(data.numpy())) != storage.nbytes():
            raise _truncated(self.path, "it ends inside a tensor")
        return data.untyped_storage()

    def read(self, meta: torch.Tensor, storages=None) -> torch.Tensor:
        """The real tensor behind a meta tensor of `.tree` (its whole storage is read, once per
        `storages` cache: views of one storage, as torch.save keeps them, stay views)."""
        storages = {} if storages is None else storages
        offset = meta.untyped_storage()._checkpoint_offset
        if offset not in storages:
            storages[offset] = self._read_storage(meta.untyped_storage())
        return torch.empty(0, dtype=meta.dtype).set_(storages[offset], meta.storage_offset(), meta.shape,
                                                     meta.stride())

    def load(self, *key):
        """The subtree at `key` (whole tree by default) with every tensor read."""
        storages = {}
        return map_tensors(self.get(*key) if key else self.tree, lambda m: self.read(m, storages))

    def close(self):
        self._file.close()
