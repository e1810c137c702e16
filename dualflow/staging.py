"""
Output folders that appear only when complete (`dualflow convert`, `dualflow finetune`): everything is written into a
hidden sibling folder, which is renamed into place at the end; an error, Ctrl-C or SIGTERM removes it and leaves no
`out`. A run holds a lock on its hidden folder while it writes, so a second run writing the same `out` fails at once.
"""

import errno
import fcntl
import glob
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

from .errors import DualFlowUserError, sigterm_as_interrupt


# Errors while writing that describe the user's file system, not a bug in our code: a one-line error naming `out`.
FILE_SYSTEM_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)


def _sibling(out: Path, purpose: str) -> Path:
    """A fresh hidden folder name next to `out` (same filesystem, so renames are atomic)."""
    return out.parent / f".{out.name}.{purpose}-{uuid.uuid4().hex[:12]}"


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        status = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return status.st_dev, status.st_ino


def _publish(staging: Path, out: Path, found: tuple[int, int] | None):
    """
    Swap the finished folder into place; an existing `out` is only removed once it is replaced. `found`: the identity
    of `out` when the run started; another process that wrote `out` since then wins, and this run fails.
    """
    if _identity(out) != found:
        raise DualFlowUserError(f"{out} was written by another process while this run was writing it; left as it is")
    if found is None:
        staging.rename(out)  # fails if a folder appeared after all: never merged into another's output
        return
    trash = _sibling(out, "old")
    out.rename(trash)
    staging.rename(out)
    if trash.is_dir() and not trash.is_symlink():
        shutil.rmtree(trash)
    else:  # a file (or a link) named `out`
        trash.unlink()


def _lock(folder: Path) -> int | None:
    """
    An exclusive lock on `folder` (its descriptor holds it), or None when another process holds one; OSError where
    the folder is gone or its file system has no locks.
    """
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(descriptor)
        if isinstance(error, BlockingIOError):
            return None
        raise
    return descriptor


def _other_writer(out: Path, staging: Path) -> Path | None:
    """The hidden folder of another live run writing `out`; leftovers of killed runs hold no lock and are ignored."""
    for other in Path(out.parent).glob(f".{glob.escape(out.name)}.partial-*"):
        if other == staging:
            continue
        try:
            descriptor = _lock(other)
        except OSError:  # gone meanwhile (that run ended), or not lockable
            continue
        if descriptor is None:
            return other
        os.close(descriptor)
    return None


def _cannot_write(out: Path, error: OSError) -> DualFlowUserError:
    return DualFlowUserError(f"cannot write the output folder {out}: {error.strerror} ({error.filename or out})")


@contextmanager
def staged_folder(out):
    """
    `with staged_folder(out) as staging:` write into `staging`; when the block ends normally it becomes `out`
    (replacing an existing `out`, which the caller has allowed), otherwise it is removed. The folder is created at
    once, so a read-only or missing location fails before any work, in one line naming the path; so does a second
    run writing the same `out`, and a run whose `out` another process wrote meanwhile fails at the end.
    """
    out = Path(out)
    staging = _sibling(out, "partial")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as error:  # a read-only file system, no permission, a file where a folder should be, ...
        raise _cannot_write(out, error) from None
    try:  # before looking for other runs: of two starting together, at least one sees the other
        lock = _lock(staging)
    except OSError:  # a file system without locks: only the check at the end finds another writer
        lock = None
    found = _identity(out)
    with sigterm_as_interrupt():  # also while cleaning up: a second SIGTERM is ignored then
        try:
            other = _other_writer(out, staging) if lock is not None else None
            if other is not None:
                raise DualFlowUserError(
                    f"another run is writing {out} (into {other}); wait for it to end or choose another output folder"
                )
            yield staging
            _publish(staging, out, found)
        except OSError as error:
            shutil.rmtree(staging, ignore_errors=True)
            if error.errno in FILE_SYSTEM_ERRNOS:
                raise _cannot_write(out, error) from None
            raise
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            if lock is not None:
                os.close(lock)
