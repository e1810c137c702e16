"""Byte-level text data for `dualflow compare` and `dualflow experiment`: token ids are the UTF-8 bytes of the text.

The default corpus is the Python standard library that ships with the running interpreter: real, local, and the same
on every machine with the same Python. Files are split into train / validation by a hash of their path, so the split
is stable and no file contributes to both sides.
"""

import sysconfig
import zlib
from pathlib import Path

import torch

from ..errors import DualFlowUserError


BYTE_VOCAB_SIZE = 256
# Test suites are large, repetitive and full of fixtures: leave them out of the default corpus.
SKIPPED_STDLIB_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}


def encode_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_bytes(ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def stdlib_source_files() -> list[Path]:
    """The interpreter's standard library `.py` files (test suites excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        path for path in root.rglob("*.py") if not SKIPPED_STDLIB_DIRS.intersection(path.relative_to(root).parts[:-1])
    ]
    if not files:
        raise DualFlowUserError(f"no Python sources found under {root}: pass text files with --data")
    return sorted(files)


def is_validation_file(path: Path, val_percent: int = 10) -> bool:
    """Stable train/validation split by file: `val_percent` % of files, chosen by a hash of the file name."""
    return zlib.crc32(f"{path.parent.name}/{path.name}".encode()) % 100 < val_percent


def split_files(files: list[Path], val_percent: int = 10) -> tuple[list[Path], list[Path]]:
    """(train files, validation files); both sides get at least one file when there are two or more, a single file
    goes to train (callers split it by position)."""
    if len(files) == 1:
        return list(files), []
    validation = [path for path in files if is_validation_file(path, val_percent)]
    train = [path for path in files if not is_validation_file(path, val_percent)]
    if len(files) >= 2 and not validation:
        train, validation = files[:-1], files[-1:]
    elif len(files) >= 2 and not train:
        train, validation = files[:1], files[1:]
    return train, validation


def read_utf8_text(path: Path) -> str:
    """The text of a data file; a file that is not UTF-8 text (a binary file) or cannot be read is a one-line error."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DualFlowUserError(f"data file {path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise DualFlowUserError(f"cannot read data file {path}: {error.strerror}") from None


def check_data_files(paths) -> list[Path]:
    """Resolve user-given --data paths; a missing, empty or binary file is a one-line user error."""
    files = [Path(path) for path in paths]
    for path in files:
        if not path.is_file():
            raise DualFlowUserError(f"--data file not found: {path}")
        if path.stat().st_size == 0:
            raise DualFlowUserError(f"--data file is empty: {path}")
        read_utf8_text(path)
    return files


def read_byte_tokens(files: list[Path], max_tokens: int | None = None) -> torch.Tensor:
    """Concatenated UTF-8 bytes of `files` (separated by a blank line) as a uint8 tensor, cut at `max_tokens`."""
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes() + b"\n\n"
        chunks.append(data)
        total += len(data)
        if max_tokens is not None and total >= max_tokens:
            break
    joined = b"".join(chunks)[:max_tokens]
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8)


def eval_blocks(tokens: torch.Tensor, block_size: int, max_blocks: int | None = None) -> torch.Tensor:
    """Non-overlapping (num_blocks, block_size) windows of `tokens` as int64 ids."""
    num_blocks = len(tokens) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    if num_blocks == 0:
        raise DualFlowUserError(f"validation data holds {len(tokens)} tokens, fewer than one block of {block_size}")
    return tokens[: num_blocks * block_size].view(num_blocks, block_size).long()


def spread_blocks(files: list[Path], block_size: int, num_blocks: int) -> tuple[torch.Tensor, int]:
    """
    (blocks, files hit): `num_blocks` windows of `block_size` tokens (int64) at evenly spaced offsets over the
    concatenated `files`, so every part of the validation set is scored, not its first files. Fewer blocks (all
    non-overlapping) when the files hold fewer than `num_blocks * block_size` tokens. `files hit` counts the files in
    which some block starts.
    """
    sizes = [path.stat().st_size + 2 for path in files]  # read_byte_tokens adds a blank line after each file
    tokens = read_byte_tokens(files)
    num_blocks = min(num_blocks, len(tokens) // block_size)
    if num_blocks == 0:
        raise DualFlowUserError(f"validation data holds {len(tokens)} tokens, fewer than one block of {block_size}")
    span = len(tokens) - block_size
    starts = torch.tensor([i * span // max(1, num_blocks - 1) for i in range(num_blocks)])
    file_ends = torch.tensor(sizes).cumsum(0)
    files_hit = torch.searchsorted(file_ends, starts, right=True).unique().numel()
    blocks = torch.stack([tokens[start : start + block_size] for start in starts.tolist()]).long()
    return blocks, files_hit


def random_batch(tokens: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator) -> torch.Tensor:
    """`batch_size` random windows of `block_size` tokens (int64), drawn with `generator`."""
    starts = torch.randint(0, len(tokens) - block_size, (batch_size,), generator=generator)
    return torch.stack([tokens[start : start + block_size] for start in starts.tolist()]).long()
