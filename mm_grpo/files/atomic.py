"""Nothing half-written: files and folders are built under a temporary name, then renamed."""
import contextlib
import errno
import os
import re
import secrets
import shutil
import tempfile

from mm_grpo.files.lock import is_dead_local_owner, owner_tag

# Our temporary folders: a training save's `.iter_0000100.tmp` / `.release.tmp` (one name for all
# ranks of the job that holds the folder's lock) and `.<name>.tmp-<host>:<pid>-<8 random>` of
# `atomic_dir` / `atomic_entries` (the owner tells whether it crashed).
TEMP_NAME_BYTES = 4  # 8 hex characters: the random part STALE_TEMP expects
TEMP_NAME_TRIES = 100
STALE_TEMP = re.compile(r"\.(?:(?:iter_\d{7}|release)\.tmp|.+\.tmp-(?P<owner>[^:/\s]+:\d+)-[a-z0-9_]{8})")


def temp_prefix(name: str) -> str:
    return f".{name}.tmp-{owner_tag()}-"


def remove_stale_temps(folder: str, name: str = None) -> list:
    """Remove what crashed writers of ours left in `folder` (only `name`'s with `name`): the
    temporary folders above whose owner is gone, or without an owner. Returns the names removed."""
    removed = []
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        match = STALE_TEMP.fullmatch(entry)
        if not match or (name is not None and not entry.startswith(f".{name}.tmp")):
            continue
        if match["owner"] is None or is_dead_local_owner(match["owner"]):
            shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
            removed.append(entry)
    return removed


def make_temp_dir(parent: str, prefix: str) -> str:
    """A new folder `<parent>/<prefix><8 random characters>` whose mode follows the umask, as any
    folder's does (tempfile.mkdtemp's is 0700 whatever the umask: a folder renamed into place
    from it would stay private to its owner)."""
    for _ in range(TEMP_NAME_TRIES):
        path = os.path.join(parent, prefix + secrets.token_hex(TEMP_NAME_BYTES))
        try:
            os.mkdir(path)  # mode 0o777 & ~umask
            return path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary folder name after {TEMP_NAME_TRIES} tries", parent)


def atomic_write_text(path: str, text: str):
    """Written, flushed to disk, then renamed over `path` (a crash leaves the old or the new text)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def replace_dir(src: str, dst: str):
    """Move folder `src` to `dst`, replacing what is there (moved aside first, deleted last)."""
    old = None
    if os.path.lexists(dst):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=os.path.dirname(dst) or ".")
        os.rename(dst, os.path.join(old, "content"))
    os.rename(src, dst)
    if old is not None:
        shutil.rmtree(old)


@contextlib.contextmanager
def atomic_dir(target: str, overwrite: bool = False):
    """Yields a temporary folder next to `target`; on success it becomes `target`, on error it is removed."""
    target = os.path.abspath(target)
    if os.path.lexists(target) and not overwrite:
        raise FileExistsError(f"{target} already exists: remove it or choose another output folder")
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = make_temp_dir(parent, temp_prefix(os.path.basename(target)))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, target)


@contextlib.contextmanager
def atomic_entries(target: str, overwrite: bool = False, last=()):
    """Yields a temporary folder inside the existing folder `target`; on success every entry built
    there moves into `target` (the names in `last` after the others, so a marker file appears
    only once the rest is in place), replacing an entry of the same name only with `overwrite`;
    on error the temporary folder is removed and `target` is as it was."""
    target = os.path.abspath(target)
    tmp = tempfile.mkdtemp(prefix=temp_prefix("entries"), dir=target)
    try:
        yield tmp
        names = sorted(os.listdir(tmp), key=lambda n: n in last)
        clashes = [n for n in names if os.path.lexists(os.path.join(target, n))]
        if clashes and not overwrite:
            raise FileExistsError(f"{target} already holds {', '.join(clashes)}: remove them or choose another "
                                  "output folder")
        for name in names:
            if os.path.isdir(os.path.join(tmp, name)):
                replace_dir(os.path.join(tmp, name), os.path.join(target, name))
            else:
                os.replace(os.path.join(tmp, name), os.path.join(target, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
