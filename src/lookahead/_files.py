"""Files that several processes share under ``$LOOKAHEAD_CACHE``: an advisory lock around their
read-modify-write, so that two processes starting at once neither lose each other's entries nor
convert the same model twice."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no lock, as before (the writes themselves stay atomic)
    fcntl = None


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) while the block runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_UN)


def umask_mode(mode: int = 0o777) -> int:
    """``mode`` as the process's umask lets files be created (mkdtemp's folders are 0700)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask
