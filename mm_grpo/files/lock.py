"""One job per run folder: a lock file holding the owner's host and pid.

The lock is created with O_EXCL, so two jobs starting together cannot both get it. A lock left by
a process of this host that no longer exists (a job killed with SIGKILL) is stale and taken over;
a lock of another host cannot be checked from here, so it is refused with its holder named.
The same host / pid test tells which temporary folders of crashed writers may be removed.
"""
import os
import socket
import time

LOCK_FILE = ".mm-grpo.lock"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def owner_tag() -> str:
    """`host:pid` of this process (how lock files and temporary folder names record their owner)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def is_dead_local_owner(tag: str) -> bool:
    """`tag` (host:pid) names a process of this host that is gone."""
    host, _, pid = tag.rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and not pid_alive(int(pid))


class RunFolderLocked(RuntimeError):
    """Another live job holds the run folder."""


class RunFolderLock:
    """`acquire()` creates `<folder>/.mm-grpo.lock` with `host:pid`; `release()` removes it (if still ours)."""

    def __init__(self, folder: str):
        self.path = os.path.join(folder, LOCK_FILE)
        self.tag = owner_tag()
        self.held = False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(self.tag + "\n")
            f.flush()
            os.fsync(f.fileno())
        return True

    def holder(self) -> str:
        try:
            with open(self.path) as f:
                return f.read().strip()
        except FileNotFoundError:
            return ""

    def acquire(self):
        for _ in range(5):  # a stale lock removed by us, or released meanwhile: try again
            if self._create():
                self.held = True
                return self
            holder = self.holder()
            if not holder:  # being written by its creator right now
                time.sleep(0.2)
                holder = self.holder()
            if holder == self.tag:
                self.held = True
                return self
            if holder and not is_dead_local_owner(holder):
                raise RunFolderLocked(f"{os.path.dirname(self.path)} is in use by the job of process {holder} "
                                      f"(lock file {self.path}); stop that job, or remove the lock file if it "
                                      "is gone")
            try:  # stale: its owner died on this host
                os.remove(self.path)
            except FileNotFoundError:
                pass
        raise RunFolderLocked(f"cannot lock {os.path.dirname(self.path)}: {self.path} keeps changing owner")

    def release(self):
        if self.held and self.holder() == self.tag:
            os.remove(self.path)
        self.held = False
