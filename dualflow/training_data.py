"""
The training data of `dualflow finetune`, read with `datasets`: local files of every tabular format it reads, folders of
them, datasets saved with `save_to_disk`, dataset repositories (a Hub id or a local copy), streamed or not. Rows hold a
text or a conversation (`messages`, rendered with the tokenizer's chat template and trained on the assistant's turns
only); `pack_data` packs them into fixed-size blocks of input ids and labels.
"""

import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet
import torch
from datasets import Dataset, load_dataset
from datasets.data_files import get_data_patterns
from datasets.exceptions import DatasetGenerationError
from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
from huggingface_hub import metadata_load
from jinja2 import TemplateError
from tqdm.auto import tqdm

from .data_paths import DATA_SUFFIXES, FILE_FORMATS, check_local_data
from .errors import DualFlowUserError
from .instruments.data import read_utf8_text


# The labels of the tokens that are not trained on (the chat around the assistant's turns).
IGNORE_INDEX = -100
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class DataSource:
    """The rows of one data file or one split of a dataset, and how error messages name it."""

    name: str  # "data file PATH" or "dataset ID (split S)"
    rows: Iterable[dict]  # a Dataset, an IterableDataset, or a .txt file's one row
    text_field: str

    @classmethod
    def of_texts(cls, texts: Iterable[str], name: str = "texts") -> "DataSource":
        """Texts in memory, one document each."""
        return cls(name, [{"text": text} for text in texts], "text")

    def documents(self) -> Iterator[tuple[int, str | list[dict]]]:
        """(row index, document) of every row: a text, or a conversation (its list of messages)."""
        index = -1
        with _reading(self.name):
            for index, row in enumerate(self.rows):
                yield index, _document(self, index, row)
        if index < 0:
            raise DualFlowUserError(f"{self.name}: no rows")


class _TextFile:
    """A .txt file as its one row, read when iterated (as a streamed dataset is)."""

    def __init__(self, path: Path):
        self.path = path

    def __iter__(self):
        yield {"text": read_utf8_text(self.path)}


def load_data(
    data, text_field: str = "text", data_split: str = "train", data_config: str | None = None, streaming: bool = False
) -> list[DataSource]:
    """
    The sources of the rows `data` names (one entry or several), in order:

    - a file: .txt (one document, read as it is), .jsonl / .json, .parquet, .csv / .tsv or .arrow (a row each);
    - a folder saved with `save_to_disk` (its `data_split` where it holds several);
    - a folder laid out as a dataset repository (configs declared in its README.md, or files named by split such as
      train-*.parquet) or a Hub dataset id: `data_config`'s `data_split`, read as `datasets.load_dataset` reads it;
    - any other folder: its data files at any depth, in path order, hidden ones left out.

    Rows give their `text_field`, or a `messages` list. With `streaming`, rows are read as `pack_data` consumes them
    (`IterableDataset`s, no Arrow cache); without, local files are converted into datasets' cache first.
    """
    entries = [data] if isinstance(data, (str, os.PathLike)) else data
    check_local_data(entries)
    sources = []
    for entry in entries:
        path = Path(entry)
        if path.is_dir():
            sources.extend(_folder(path, text_field, data_split, data_config, streaming))
        elif path.exists():
            sources.append(_file(path, text_field, streaming))
        else:  # a Hub dataset id (check_local_data)
            with _reading(f"data {entry} (no such file or folder; as a Hub dataset, split {data_split})"):
                rows = load_dataset(str(entry), data_config, split=data_split, streaming=streaming)
            sources.append(DataSource(_dataset_name(entry, data_config, data_split), rows, text_field))
    return sources


def pack_data(
    sources: list[DataSource], tokenizer, block_size: int, max_blocks: int | None = None, progress: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Tokenize the sources' documents, join them and cut into blocks: the input ids and the labels, both (num_blocks,
    block_size). A text is followed by EOS and trained on in full (labels = input ids; the model shifts them); a
    conversation is rendered by the tokenizer's chat template and trained on its assistant turns only (labels -100
    elsewhere). The short tail is dropped, and so is a block without a label to train on. Reading stops at
    `max_blocks` blocks (a streamed corpus is read no further). `progress` shows a progress bar.
    """
    input_ids, labels = [], []
    pending_ids, pending_labels = [], []  # tokens not in a block yet
    num_tokens = 0
    try:
        total = sum(len(source.rows) for source in sources)
    except TypeError:  # streamed: the number of rows is not known
        total = None
    with (
        _quiet_datasets(),
        tqdm(_documents(sources), total=total, desc="tokenizing", unit=" documents", disable=not progress) as rows,
    ):
        for source, index, document in rows:
            ids, targets = _tokenize(tokenizer, document, f"{source.name}, row {index}")
            num_tokens += len(ids)
            pending_ids += ids
            pending_labels += targets
            start = 0
            while len(pending_ids) - start >= block_size and len(input_ids) != max_blocks:
                block_labels = pending_labels[start : start + block_size]
                # A block within a long prompt has nothing to learn (the model predicts labels[1:]): its loss is NaN.
                if any(label != IGNORE_INDEX for label in block_labels[1:]):
                    input_ids.append(torch.tensor(pending_ids[start : start + block_size]))
                    labels.append(torch.tensor(block_labels))
                start += block_size
            del pending_ids[:start], pending_labels[:start]
            if len(input_ids) == max_blocks:
                break
    if len(input_ids) < 2:
        raise DualFlowUserError(
            f"the data has {num_tokens} token{'s' * (num_tokens != 1)} ({len(input_ids)} blocks with tokens to train "
            f"on): at least 2 blocks "
            f"of --block-size {block_size} are needed (more text or a smaller --block-size)"
        )
    return torch.stack(input_ids), torch.stack(labels)


def blocks_for_steps(max_steps: int, batch_size: int, eval_fraction: float) -> int:
    """
    How many blocks to pack for `max_steps` optimizer steps of `batch_size` blocks (all devices and accumulation
    steps together) once `split_blocks` holds out `eval_fraction` of them: where to stop reading a stream.
    """
    # One block more than the share needed covers split_blocks' rounding of the held-out count.
    return math.ceil((max_steps * batch_size + 1) / (1 - eval_fraction)) + 1


def _folder(folder: Path, text_field, data_split, data_config, streaming) -> list[DataSource]:
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        return [_saved_dataset(folder, text_field, data_split, streaming)]
    files = sorted(
        file
        for file in folder.rglob("*")
        if file.suffix in DATA_SUFFIXES
        and file.is_file()
        and not any(part.startswith(".") for part in file.relative_to(folder).parts)
    )
    if not files:
        raise DualFlowUserError(f"data folder {folder} holds no data file ({', '.join(DATA_SUFFIXES)})")
    with _reading(f"data folder {folder}"):
        repository = _is_dataset_repository(folder)
    if not repository:
        return [_file(file, text_field, streaming) for file in files]
    name = _dataset_name(folder, data_config, data_split)
    with _reading(name), _quiet_datasets():
        rows = load_dataset(str(folder), data_config, split=data_split, streaming=streaming)
    return [DataSource(name, rows, text_field)]


def _is_dataset_repository(folder: Path) -> bool:
    """Whether `folder` declares configs in its README.md, or names its files by split (train-*, test-*, ...)."""
    readme = folder / "README.md"
    if readme.is_file() and "configs" in (metadata_load(readme) or {}):
        return True
    return len(get_data_patterns(str(folder))) > 1


def _file(path: Path, text_field: str, streaming: bool) -> DataSource:
    name = f"data file {path}"
    if path.suffix == ".txt":
        return DataSource(name, _TextFile(path) if streaming else [{"text": read_utf8_text(path)}], "text")
    if path.suffix not in FILE_FORMATS:
        raise DualFlowUserError(
            f"data file {path} must end in .txt (one document), .jsonl / .json, .parquet, .csv / .tsv or .arrow, or "
            "be a folder of such files"
        )
    builder, options = FILE_FORMATS[path.suffix]
    with _reading(name), _quiet_datasets():
        # datasets fails on a parquet file without rows (a row group of 0 rows: "BatchSize must be greater than 0")
        if path.suffix == ".parquet" and pyarrow.parquet.read_metadata(path).num_rows == 0:
            raise DualFlowUserError(f"{name}: no rows")
        rows = load_dataset(builder, data_files=str(path), split="train", streaming=streaming, **options)
    return DataSource(name, rows, text_field)


def _saved_dataset(folder: Path, text_field: str, data_split: str, streaming: bool) -> DataSource:
    """A dataset saved with `save_to_disk`: a Dataset, or a DatasetDict (only `data_split` is loaded)."""
    name = f"dataset {folder}"
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        if data_split not in splits:
            raise DualFlowUserError(f"{name} has no split {data_split!r} (its splits: {', '.join(splits)})")
        name, folder = f"{name} (split {data_split})", folder / data_split
    if not any(folder.glob("*.arrow")):  # datasets fails with an IndexError on an empty saved dataset
        raise DualFlowUserError(f"{name}: no rows")
    with _reading(name):
        rows = Dataset.load_from_disk(str(folder))
    return DataSource(name, rows.to_iterable_dataset() if streaming else rows, text_field)


def _dataset_name(dataset, config: str | None, split: str) -> str:
    return f"dataset {dataset} ({f'config {config}, ' if config else ''}split {split})"


def _documents(sources: list[DataSource]) -> Iterator[tuple[DataSource, int, str | list[dict]]]:
    for source in sources:
        for index, document in source.documents():
            yield source, index, document


def _document(source: DataSource, index: int, row: dict) -> str | list[dict]:
    """A row's text, or its conversation where it has `messages` and no text; anything else is a one-line error."""
    where, field = f"{source.name}, row {index}", source.text_field
    text = row.get(field)
    if isinstance(text, str):
        return text
    if text is None and row.get("messages") is not None:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(message, dict) and isinstance(message.get("role"), str) for message in messages
        ):
            raise DualFlowUserError(f'{where}: field "messages" is not a list of {{"role": ..., "content": ...}}')
        return messages
    if text is None:  # a field a row lacks is null where the file's other rows have it
        fields = ", ".join(key for key, value in row.items() if value is not None) or "none"
        raise DualFlowUserError(f'{where}: no {json.dumps(field)} field (nor "messages"); its fields: {fields}')
    raise DualFlowUserError(f"{where}: field {json.dumps(field)} holds {type(text).__name__}, not a string")


def _tokenize(tokenizer, document: str | list[dict], where: str) -> tuple[list[int], list[int]]:
    """The input ids and labels of a document."""
    if isinstance(document, str):
        ids = tokenizer(document, add_special_tokens=False, verbose=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        return ids, ids
    if tokenizer.chat_template is None:
        raise DualFlowUserError(f'{where}: the "messages" field needs a chat template, and the tokenizer has none')
    try:
        ids, assistant = _chat_tokens(tokenizer, document)
    except TemplateError as error:
        raise DualFlowUserError(f'{where}: the chat template fails on "messages": {error}') from None
    return ids, [token if trained else IGNORE_INDEX for token, trained in zip(ids, assistant)]


def _chat_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """A conversation's token ids in the chat template, and 1 for the tokens of the assistant's turns (else 0)."""
    template = tokenizer.chat_template
    # Only a fast tokenizer maps the characters within {% generation %} markers to tokens.
    if tokenizer.is_fast and isinstance(template, str) and GENERATION_MARKER.search(template):
        encoded = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        return encoded["input_ids"], encoded["assistant_masks"]
    # Otherwise an assistant turn starts where the conversation before it ends (rendered with the generation prompt)
    # and ends where the conversation up to it ends: as long as the template renders every prefix of a conversation as
    # a prefix of its whole, which the common prefix guards against where it does not.
    ids = _render(tokenizer, messages)
    assistant = [0] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = _render(tokenizer, messages[:turn], add_generation_prompt=True) if turn else []
            start = _common_prefix_length(prompt, ids)
            end = _common_prefix_length(_render(tokenizer, messages[: turn + 1]), ids)
            assistant[start:end] = [1] * (end - start)
    return ids, assistant


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=True)[
        "input_ids"
    ]


def _common_prefix_length(ids: list[int], other: list[int]) -> int:
    length = 0
    while length < min(len(ids), len(other)) and ids[length] == other[length]:
        length += 1
    return length


@contextmanager
def _reading(name: str):
    """Whatever datasets raises on a file or dataset it cannot read becomes one line naming it."""
    try:
        yield
    except DualFlowUserError:
        raise
    except Exception as error:
        raise DualFlowUserError(f"{name}: {_reason(error)}") from None


def _reason(error: BaseException) -> str:
    """The telling part of a reading error: what pyarrow or the decoder said, under datasets' generic wrappers."""
    chain = [error]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and cause not in chain:
        chain.append(cause)
    for cause in chain:
        if isinstance(cause, UnicodeDecodeError):
            return f"not UTF-8 text ({cause.reason})"  # the position is in a chunk of the file
        if isinstance(cause, StopIteration):  # datasets' JSON reader, on a file without rows
            return "no rows"
    arrow = [cause for cause in chain if isinstance(cause, pyarrow.ArrowException)]
    cause = (arrow + [cause for cause in chain if not isinstance(cause, DatasetGenerationError)] + chain)[0]
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    return (str(cause).strip().splitlines() or [type(cause).__name__])[0]


@contextmanager
def _quiet_datasets():
    """
    datasets' progress bars and logs off while it reads local data: a bar per file would bury ours, and what it logs
    about a file it cannot read is what the one-line error says.
    """
    verbosity, bars_were_off = datasets.logging.get_verbosity(), are_progress_bars_disabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars_were_off:
            enable_progress_bars()
