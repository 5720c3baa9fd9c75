"""One run per output folder: an exclusive lock on ``<output_dir>/run.lock`` for the run's life.

    lock = RunLock(output_dir)   # raises LockedError naming the folder and the holder's pid
    ...
    lock.release()

The lock is ``flock`` on an open file, so the kernel drops it when the holder's process ends,
however it ends (a SIGKILL, a crash, a lost machine of the same host). A lock file left by a
killed run is therefore stale by construction: the next run takes it over and says whose it
was. The file holds the holder's pid, only for the message, and is removed when the lock is
released, so a run leaves no trace of it. Only the process that writes files (the coordinator of
a multi-host run) takes the lock.
"""

from __future__ import annotations

import fcntl
import os

FILE = "run.lock"


class LockedError(RuntimeError):
    """Another live process holds the folder's lock. str(e) is one line naming the folder and its pid."""


class RunLock:
    def __init__(self, output_dir: str, *, file: str = FILE, flag: str = "--output-dir"):
        """Takes the lock of ``output_dir`` (which must exist) without waiting: the file ``file`` in it (one per
        process of a ``python -m train predict`` on a pod, which share an output folder). ``previous`` is the pid
        of a run that held it and died (a stale lock taken over), or None. ``flag`` names the folder in errors."""
        self.path = os.path.join(output_dir, file)
        while True:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(self._fd)
                os.close(self._fd)
                raise LockedError(f"{flag}: {output_dir} is in use by another run (pid {holder or 'unknown'}, "
                                  f"lock {self.path}); wait for it to end or pick another folder") from None
            if _same_file(self._fd, self.path):
                break
            os.close(self._fd)  # locked a file its holder removed while releasing: take the new one
        self.previous = _read_pid(self._fd)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        os.fsync(self._fd)

    def release(self) -> None:
        """Ends the lock and removes its file (before unlocking: a run waiting on it then retries)."""
        if self._fd is None:
            return
        os.remove(self.path)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdecimal() else None


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
