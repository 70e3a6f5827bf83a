"""Nothing half-written: files and folders are built under a temporary name, then renamed."""
import contextlib
import os
import shutil
import tempfile


def atomic_write_text(path: str, text: str):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
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
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
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
    tmp = tempfile.mkdtemp(prefix=".entries.tmp-", dir=target)
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
