"""
Output folders that appear only when complete (`dualflow convert`, `dualflow finetune`): everything is written into a
hidden sibling folder, which is renamed into place at the end; an error, Ctrl-C or SIGTERM removes it and leaves no
`out`.
"""

import errno
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


def _publish(staging: Path, out: Path):
    """Swap the finished folder into place; an existing `out` is only removed once it is replaced."""
    if not out.exists():
        staging.rename(out)
        return
    trash = _sibling(out, "old")
    out.rename(trash)
    staging.rename(out)
    if trash.is_dir() and not trash.is_symlink():
        shutil.rmtree(trash)
    else:  # a file (or a link) named `out`
        trash.unlink()


def _cannot_write(out: Path, error: OSError) -> DualFlowUserError:
    return DualFlowUserError(f"cannot write the output folder {out}: {error.strerror} ({error.filename or out})")


@contextmanager
def staged_folder(out):
    """
    `with staged_folder(out) as staging:` write into `staging`; when the block ends normally it becomes `out`
    (replacing an existing `out`, which the caller has allowed), otherwise it is removed. The folder is created at
    once, so a read-only or missing location fails before any work, in one line naming the path.
    """
    out = Path(out)
    staging = _sibling(out, "partial")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as error:  # a read-only file system, no permission, a file where a folder should be, ...
        raise _cannot_write(out, error) from None
    with sigterm_as_interrupt():  # also while cleaning up: a second SIGTERM is ignored then
        try:
            yield staging
            _publish(staging, out)
        except OSError as error:
            shutil.rmtree(staging, ignore_errors=True)
            if error.errno in FILE_SYSTEM_ERRNOS:
                raise _cannot_write(out, error) from None
            raise
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
