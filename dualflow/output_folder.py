"""
The output folder of `dualflow convert` and `dualflow finetune`, written in place as transformers' Trainer writes its
`output_dir` (checkpoints as `OUT/checkpoint-N`): no hidden staging folder and no rename, so OUT may be `.`, a mount
point or a symbolic link (written through to its target).

While a run writes, OUT holds a visible marker, `dualflow-unfinished.json`, removed as the run's last step: a folder
that still has it was stopped (SIGKILL, power loss) before it was complete, and the next run into it says so or
resumes it. The run holds a lock on OUT, so a second run writing the same folder fails at once. When a run fails,
what it wrote is removed except what the caller keeps (finetune: its complete checkpoints); a folder the run created
and left empty is removed with the parent folders it created. A run only ever removes names a run of its command
writes (RUN_OUTPUTS): a file the user put into OUT (notes, plots made from kept checkpoints) stays, as it does with
transformers' Trainer.
"""

import errno
import fcntl
import fnmatch
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from .checkpoint import TOKENIZER_PATTERNS
from .errors import DualFlowUserError, terminating_signals_as_interrupt


UNFINISHED_MARKER = "dualflow-unfinished.json"
WRITE_PROBE = ".write-probe"
# What `save_pretrained` writes for a Dual-Flow model (weights, config, remote code), its card and its tokenizer.
MODEL_FOLDER_PATTERNS = (
    "config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "*_dualflow.py",
    "README.md",
    *TOKENIZER_PATTERNS,
)
# The names a run of each command writes into OUT: the only entries it may remove.
RUN_OUTPUTS = {
    "convert": MODEL_FOLDER_PATTERNS,
    "quantize": MODEL_FOLDER_PATTERNS,
    "finetune": (*MODEL_FOLDER_PATTERNS, "checkpoint-*", "adapter_config.json", "adapter_model.safetensors"),
}
# The commands whose --overwrite replaces a Dual-Flow model in OUT.
OVERWRITE_COMMANDS = ("convert", "quantize")
# Errors while writing that describe the user's file system, not a bug in our code: a one-line error naming OUT.
FILE_SYSTEM_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# An OS error code inside another library's message: Python's "[Errno 28]", Rust's "(os error 28)" (safetensors) and
# its debug form "Os { code: 28, ...".
OS_ERROR_CODE = re.compile(r"\[Errno (\d+)\]|\(os error (\d+)\)|\bcode: (\d+)\b")
# Bytes written to test whether a file system is full: a write that failed leaves less than this free.
PROBE_BYTES = 1 << 16


def cannot_write(out, error: OSError) -> DualFlowUserError:
    return DualFlowUserError(f"cannot write the output folder {out}: {error.strerror}")


def unfinished_run(folder: Path) -> dict | None:
    """The marker of a run that was writing `folder` and did not end ({"command": ...}), None if there is none."""
    try:
        return json.loads((folder / UNFINISHED_MARKER).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # unreadable: still a run that did not end
        return {"command": "unknown"}


def file_system_error(error: BaseException, folder: Path) -> OSError | None:
    """
    The file system's refusal behind a failed write (full disk, quota, file size limit, read-only, permission), None
    for any other failure. torch and safetensors report a full disk in messages of their own: an OSError in the
    exception's chain, else an OS error code in a message of the chain (OS_ERROR_CODE),
    else a probe write into `folder`.
    """
    cause = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in FILE_SYSTEM_ERRNOS:
            return cause
        code = OS_ERROR_CODE.search(str(cause))
        if code is not None and int(next(filter(None, code.groups()))) in FILE_SYSTEM_ERRNOS:
            number = int(next(filter(None, code.groups())))
            return OSError(number, os.strerror(number))
        cause = cause.__cause__ or cause.__context__
    probe = folder / WRITE_PROBE
    try:
        with open(probe, "wb") as file:
            file.write(bytes(PROBE_BYTES))
            file.flush()
            os.fsync(file.fileno())
    except OSError as probe_error:
        return probe_error if probe_error.errno in FILE_SYSTEM_ERRNOS else None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    return None


def check_output_folder(out, command: str, resume: bool = False, replace: bool = False) -> bool:
    """
    A one-line error for an OUT that `dualflow COMMAND` may not write: a file, a folder another run is writing, or a
    folder that is not empty, unless it holds an unfinished run of `command` and `resume`, or `replace` and it holds
    nothing but a Dual-Flow model or an unfinished conversion. Returns whether there is a run to resume.
    """
    path = Path(os.path.realpath(out))
    if path.is_dir() and (lock := _lock(path, out)) is not None:
        os.close(lock)
    return _check_contents(path, out, command, resume, replace)


def written_by_run(entry: Path, command: str) -> bool:
    """Whether `entry` of OUT has a name a `dualflow COMMAND` run writes (and so may remove)."""
    patterns = (*RUN_OUTPUTS[command], UNFINISHED_MARKER, WRITE_PROBE)
    return any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in patterns)


def foreign_entries(folder: Path, command: str) -> list[Path]:
    """The entries of `folder` that no `dualflow COMMAND` run writes: the user's, which a run never removes."""
    return sorted(entry for entry in folder.iterdir() if not written_by_run(entry, command))


def _names(entries: list[Path], at_most: int = 3) -> str:
    """A few entries' names for a one-line message (folders with a trailing slash)."""
    names = [entry.name + ("/" if entry.is_dir() and not entry.is_symlink() else "") for entry in entries]
    more = f" and {len(names) - at_most} more" if len(names) > at_most else ""
    return ", ".join(names[:at_most]) + more


def holds_model(folder: Path) -> bool:
    """Whether `folder` holds a saved Dual-Flow model or adapter (a finished run of convert or finetune)."""
    if (folder / "adapter_config.json").is_file():
        return True
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") == "dualflow"
    except (OSError, ValueError, AttributeError):
        return False


def _check_contents(path: Path, out, command: str, resume: bool, replace: bool) -> bool:
    """`check_output_folder` but for the lock: for the run that holds it."""
    if path.exists() and not path.is_dir():
        raise DualFlowUserError(f"output folder {out} exists and is not a folder")
    if not path.is_dir() or not any(path.iterdir()):
        return False
    unfinished = unfinished_run(path)
    if unfinished is not None and unfinished.get("command") == command and resume:
        return True
    # --overwrite (convert, quantize) replaces a Dual-Flow model or an unfinished run, nothing of the user's.
    foreign = foreign_entries(path, command)
    has_overwrite = command in OVERWRITE_COMMANDS
    unfinished_here = (unfinished or {}).get("command") == command
    replaceable = has_overwrite and (holds_model(path) or unfinished_here) and not foreign
    if replace and replaceable:
        return False
    if replace:
        what = f"files that are not a Dual-Flow model's ({_names(foreign)})" if foreign else "no Dual-Flow model"
        raise DualFlowUserError(
            f"output folder {out} holds {what}: --overwrite replaces only a Dual-Flow model or an unfinished "
            "conversion; choose another output folder"
        )
    if has_overwrite:
        go_on = "pass --overwrite to replace it" if replaceable else "choose another output folder"
    else:
        go_on = "choose another --output-dir"
    if unfinished is not None:
        raise DualFlowUserError(
            f"output folder {out} holds an unfinished `dualflow {unfinished.get('command')}` run (stopped before it "
            f"ended: see its {UNFINISHED_MARKER}); {go_on}"
        )
    if holds_model(path):
        raise DualFlowUserError(f"output folder {out} holds a finished run (a saved Dual-Flow model); {go_on}")
    raise DualFlowUserError(
        f"output folder {out} already exists and is not empty ({_names(sorted(path.iterdir()))}); {go_on}"
    )


def _lock(path: Path, shown) -> int | None:
    """
    A descriptor holding an exclusive lock on the folder `path` (closing it releases the lock); None on a file system
    without locks. Another run holding the lock is a one-line error.
    """
    descriptor = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(descriptor)
        if isinstance(error, BlockingIOError):
            raise DualFlowUserError(
                f"another run is writing {shown}; wait for it to end or choose another output folder"
            ) from None
        return None
    return descriptor


class OutputFolder:
    """
    OUT while a run writes it. `path`: where the files go (a symbolic link's target); `shown`: OUT as the user named
    it, for messages; `resumed`: it held an unfinished run of the same command, which this run goes on with.
    """

    def __init__(self, out, command: str):
        self.shown = Path(out)
        self.path = Path(os.path.realpath(out))
        self.command = command
        self.resumed = False
        self._created: list[Path] = []  # folders this run made (OUT and missing parents), outermost first
        self._lock: int | None = None

    def check_free_space(self, needed_bytes: int, what: str) -> None:
        """A one-line error before any work when OUT's file system has less than `needed_bytes` free."""
        free = shutil.disk_usage(self.path).free
        if free < needed_bytes:
            raise DualFlowUserError(
                f"the output folder {self.shown} has {free / 2**20:.1f} MiB free; {what} needs about "
                f"{needed_bytes / 2**20:.1f} MiB: free some space or choose another output folder"
            )

    def _create(self):
        missing = []
        folder = self.path
        while not folder.exists():
            missing.append(folder)
            folder = folder.parent
        for folder in reversed(missing):
            folder.mkdir()
            self._created.append(folder)

    def start(self, resume: bool, replace: bool):
        # Until the marker is written, a failure touches nothing that was in OUT: only the folders this run made go.
        try:
            if self.path.exists() and not self.path.is_dir():
                raise DualFlowUserError(f"output folder {self.shown} exists and is not a folder")
            self._create()
            self._lock = _lock(self.path, self.shown)
            self.resumed = _check_contents(self.path, self.shown, self.command, resume, replace)
        except BaseException as error:
            self._remove_created_folders()
            self._unlock()
            if isinstance(error, OSError):  # a read-only file system, no permission, ...
                raise cannot_write(self.shown, error) from None
            raise
        try:
            if replace:  # _check_contents allowed it: OUT holds nothing but a run's outputs
                for entry in self.path.iterdir():
                    if written_by_run(entry, self.command):
                        remove(entry)
            marker = {"command": self.command, "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            (self.path / UNFINISHED_MARKER).write_text(json.dumps(marker) + "\n")
        except BaseException as error:
            if self.resumed:  # the run it goes on with stays as it was, marker included
                self._unlock()
            else:
                self.fail(keep=lambda folder: [])
            if isinstance(error, OSError):
                raise cannot_write(self.shown, error) from None
            raise

    def finish(self):
        # safetensors writes through a private temporary file (mode 0600): give every file the mode any other new
        # file gets, as `dualflow convert`'s own writer does.
        umask = os.umask(0)
        os.umask(umask)
        for entry in self.path.iterdir():
            if entry.is_file() and not entry.is_symlink():
                entry.chmod(0o666 & ~umask)
        (self.path / UNFINISHED_MARKER).unlink()
        self._unlock()

    def fail(self, keep: Callable[[Path], list[Path]]):
        """
        Remove what this run wrote but what `keep(path)` names (entries of OUT); with nothing kept, OUT goes back to
        what it was (absent, empty, or holding only the user's files), else the marker stays and tells the next run.
        """
        try:
            kept = set(keep(self.path)) if self.path.is_dir() else set()
            for entry in self.path.iterdir() if self.path.is_dir() else ():
                if entry in kept or (kept and entry.name == UNFINISHED_MARKER):  # the marker tells the next run
                    continue
                if written_by_run(entry, self.command):
                    remove(entry)
            if not kept:
                self._remove_created_folders()
        finally:
            self._unlock()

    def _remove_created_folders(self):
        for folder in reversed(self._created):  # innermost first; a folder someone else filled stays
            try:
                folder.rmdir()
            except OSError:
                break

    def _unlock(self):
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def remove(path: Path):
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def output_folder(
    out,
    command: str,
    resume: bool = False,
    replace: bool = False,
    keep: Callable[[Path], list[Path]] = lambda folder: [],
):
    """
    `with output_folder(out, "convert") as folder:` write into `folder.path`. OUT is created (with its parents) and
    locked at once, so an unwritable location fails before any work, in one line naming it. An existing OUT must be
    empty, or hold an unfinished run of `command` when `resume` (the block goes on with it: `folder.resumed`), or,
    when `replace`, hold nothing but a Dual-Flow model or an unfinished conversion, which is removed first. Any failure (an error, Ctrl-C, SIGTERM, SIGHUP) removes what the run wrote but
    what `keep(folder.path)` returns; a file-system error becomes one line naming OUT.
    """
    folder = OutputFolder(out, command)
    with terminating_signals_as_interrupt():  # also while cleaning up: a second signal is ignored then
        folder.start(resume, replace)
        try:
            yield folder
            folder.finish()
        except BaseException as error:
            write_error = file_system_error(error, folder.path) if isinstance(error, Exception) else None
            folder.fail(keep)
            if write_error is not None and not isinstance(error, DualFlowUserError):
                raise cannot_write(folder.shown, write_error) from None
            raise
