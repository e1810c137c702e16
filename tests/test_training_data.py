"""The finetune data reader on `datasets` (dualflow.training_data): every format, folders, saved datasets, dataset
repositories, chat rows trained on the assistant's turns, streaming, and the one-line errors of bad data."""

import json
import re
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet
import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDataset
from helpers import stdlib_text
from tokenizers import Tokenizer, decoders, models
from transformers import ByT5Tokenizer, PreTrainedTokenizerFast

from dualflow.data_paths import is_hub_dataset_id
from dualflow.errors import DualFlowUserError
from dualflow.finetune import split_blocks
from dualflow.training_data import IGNORE_INDEX, blocks_for_steps, load_data, pack_data


pytestmark = [
    pytest.mark.filterwarnings("error"),  # a warning fails the tests of `dualflow finetune`
    # datasets' CSV reader leaves its file open when a stream is left early (here: at a bad row)
    pytest.mark.filterwarnings("ignore:unclosed file:ResourceWarning"),
    pytest.mark.filterwarnings("ignore:Exception ignored in. <_io.FileIO:pytest.PytestUnraisableExceptionWarning"),
]

BLOCK = 64
DOCUMENTS = [stdlib_text(name, chars=600) for name in ("textwrap.py", "shlex.py", "glob.py", "fnmatch.py", "bisect.py")]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message.role }}: "
    "{% if message.role == 'assistant' %}{% generation %}{{ message.content }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
PLAIN_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CONVERSATIONS = [
    [
        {"role": "system", "content": "You answer with Python."},
        {"role": "user", "content": "How is text wrapped?"},
        {"role": "assistant", "content": stdlib_text("textwrap.py", chars=150)},
        {"role": "user", "content": "And shell words split?"},
        {"role": "assistant", "content": stdlib_text("shlex.py", chars=120)},
    ],
    [
        {"role": "user", "content": "A glob, please."},
        {"role": "assistant", "content": stdlib_text("glob.py", chars=200)},
    ],
]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory, monkeypatch):
    """datasets converts local files into its cache: a folder of the test's own, outside its data folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("datasets-cache"))


def write(path, rows: list[dict]):
    """`rows` as a data file in the format of `path`'s suffix."""
    table = pyarrow.Table.from_pylist(rows)
    if path.suffix == ".arrow":
        with pyarrow.ipc.new_stream(path, table.schema) as writer:
            writer.write_table(table)
    elif path.suffix == ".parquet":
        pyarrow.parquet.write_table(table, path)
    elif path.suffix in (".csv", ".tsv"):
        table.to_pandas().to_csv(path, sep="\t" if path.suffix == ".tsv" else ",", index=False)
    else:
        lines = [json.dumps(row) for row in rows]
        path.write_text("\n".join(lines) + "\n" if path.suffix == ".jsonl" else f"[{', '.join(lines)}]")
    return path


def packed(data, tokenizer=None, block_size=BLOCK, max_blocks=None, **options):
    return pack_data(load_data(data, **options), tokenizer or ByT5Tokenizer(), block_size, max_blocks)


def text_blocks(texts, block_size=BLOCK) -> torch.Tensor:
    """The blocks of plain texts, packed by hand: each text's tokens and EOS, joined, cut, the short tail dropped."""
    tokenizer = ByT5Tokenizer()
    ids = [
        i for text in texts for i in [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    ]
    return torch.tensor(ids[: len(ids) // block_size * block_size]).view(-1, block_size)


def assert_text_blocks(result, texts, block_size=BLOCK):
    input_ids, labels = result
    assert torch.equal(input_ids, text_blocks(texts, block_size))
    assert torch.equal(labels, input_ids)


def test_txt_and_jsonl_documents_are_packed_in_path_order(tmp_path):
    (tmp_path / "corpus" / "a").mkdir(parents=True)
    (tmp_path / "corpus" / ".cache").mkdir()
    (tmp_path / "corpus" / "b.txt").write_bytes(DOCUMENTS[0].replace("\n", "\r\n").encode())  # read as text is
    rows = [{"body": DOCUMENTS[1]}, {"body": DOCUMENTS[2], "id": 2}]
    (tmp_path / "corpus" / "a" / "x.jsonl").write_text(f"{json.dumps(rows[0])}\n\n{json.dumps(rows[1])}\n")
    (tmp_path / "corpus" / ".cache" / "c.txt").write_text("hidden: left out")
    (tmp_path / "corpus" / "notes.md").write_text("not a data file: left out")
    (tmp_path / "d.txt").write_text(DOCUMENTS[3])
    data = [tmp_path / "corpus", tmp_path / "d.txt"]
    for streaming in (False, True):
        result = packed(data, text_field="body", streaming=streaming)
        # in path order: the folder's files (a/x.jsonl's rows, b.txt), then d.txt
        assert_text_blocks(result, [DOCUMENTS[1], DOCUMENTS[2], DOCUMENTS[0], DOCUMENTS[3]])


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv", ".tsv", ".arrow"])
def test_every_format_reads_its_rows(tmp_path, suffix):
    rows = [{"id": index, "text": text} for index, text in enumerate(DOCUMENTS)]
    data = write(tmp_path / f"corpus{suffix}", rows)
    assert_text_blocks(packed(data), DOCUMENTS)
    assert_text_blocks(packed(data, streaming=True), DOCUMENTS)


def test_a_folder_of_mixed_formats_reads_every_file_in_path_order(tmp_path):
    (tmp_path / "b").mkdir()
    write(tmp_path / "a.parquet", [{"text": DOCUMENTS[0]}, {"text": DOCUMENTS[1]}])
    write(tmp_path / "b" / "c.csv", [{"text": DOCUMENTS[2]}])
    (tmp_path / "b" / "d.txt").write_text(DOCUMENTS[3])
    write(tmp_path / "e.jsonl", [{"text": DOCUMENTS[4]}])
    assert_text_blocks(packed(tmp_path), DOCUMENTS)


def repository(folder):
    """A dataset repository as the Hub lays one out: configs in the README's YAML, a parquet file per split."""
    for config, texts in (("small", DOCUMENTS[:2]), ("large", DOCUMENTS)):
        (folder / config).mkdir(parents=True)
        write(folder / config / "train-00000-of-00001.parquet", [{"text": text} for text in texts])
        write(folder / config / "test-00000-of-00001.parquet", [{"text": text} for text in reversed(texts)])
    configs = [
        {
            "config_name": config,
            "data_files": [{"split": split, "path": f"{config}/{split}-*"} for split in ("train", "test")],
        }
        for config in ("small", "large")
    ]
    configs[1]["default"] = True
    (folder / "README.md").write_text(f"---\nconfigs: {json.dumps(configs)}\n---\n# A tiny dataset\n")
    return folder


@pytest.mark.parametrize("streaming", [False, True])
def test_a_dataset_repository_reads_the_config_and_split_asked_for(tmp_path, streaming):
    data = repository(tmp_path / "repo")
    assert_text_blocks(packed(data, streaming=streaming), DOCUMENTS)  # the default config's train split
    result = packed(data, data_config="small", data_split="test", streaming=streaming)
    assert_text_blocks(result, DOCUMENTS[1::-1])
    [source] = load_data(data, data_config="small", data_split="test", streaming=streaming)
    assert source.name == f"dataset {data} (config small, split test)"
    assert isinstance(source.rows, IterableDataset) == streaming


def test_a_folder_of_files_named_by_split_reads_the_split_asked_for(tmp_path):
    write(tmp_path / "train.jsonl", [{"text": text} for text in DOCUMENTS[:3]])
    write(tmp_path / "test.jsonl", [{"text": text} for text in DOCUMENTS[3:]])
    assert_text_blocks(packed(tmp_path), DOCUMENTS[:3])
    assert_text_blocks(packed(tmp_path, data_split="test", block_size=32), DOCUMENTS[3:], block_size=32)


def test_datasets_saved_to_disk(tmp_path):
    texts = {"train": DOCUMENTS[:3], "validation": DOCUMENTS[3:]}
    saved = DatasetDict({split: Dataset.from_dict({"text": rows}) for split, rows in texts.items()})
    saved.save_to_disk(tmp_path / "dict")
    saved["train"].save_to_disk(tmp_path / "one")
    for streaming in (False, True):
        assert_text_blocks(packed(tmp_path / "dict", streaming=streaming), texts["train"])
        result = packed(tmp_path / "dict", data_split="validation", block_size=32, streaming=streaming)
        assert_text_blocks(result, texts["validation"], block_size=32)
        assert_text_blocks(packed(tmp_path / "one", data_split="other", streaming=streaming), texts["train"])


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A fast tokenizer of one token per character (tab, newline, printable ASCII) with an EOS token."""
    characters = ["<pad>", "</s>", "<unk>", "\t", "\n"] + [chr(code) for code in range(32, 127)]
    tokenizer = Tokenizer(models.BPE(vocab={character: index for index, character in enumerate(characters)}, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def expected_chat(tokenizer, messages) -> tuple[list[int], list[int]]:
    """A conversation's ids and labels by hand: the assistant's content and EOS trained on, the rest -100."""
    ids, labels = [], []
    for message in messages:
        trained = message["role"] == "assistant"
        head = tokenizer(f"{message['role']}: ", add_special_tokens=False)["input_ids"]
        end = tokenizer.eos_token if trained else "\n"
        body = tokenizer(message["content"] + end, add_special_tokens=False)["input_ids"]
        ids += head + body
        labels += [IGNORE_INDEX] * len(head) + (body if trained else [IGNORE_INDEX] * len(body))
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)  # the template's text
    return ids, labels


@pytest.mark.parametrize(
    "make_tokenizer, template",
    [
        (char_tokenizer, CHAT_TEMPLATE),  # the assistant tokens mask of {% generation %}
        (char_tokenizer, PLAIN_CHAT_TEMPLATE),  # no markers: spans of the rendered prefixes
        (ByT5Tokenizer, CHAT_TEMPLATE),  # markers, but a Python tokenizer: spans of the rendered prefixes
    ],
    ids=["generation-markers", "no-markers", "python-tokenizer"],
)
def test_chat_rows_are_trained_on_the_assistant_turns_only(tmp_path, make_tokenizer, template):
    tokenizer = make_tokenizer()
    tokenizer.chat_template = template
    rows = [{"messages": CONVERSATIONS[0]}, {"text": DOCUMENTS[0][:100]}, {"messages": CONVERSATIONS[1]}]
    data = write(tmp_path / "chat.jsonl", rows)  # text and chat rows in one file
    ids, labels = [], []
    for row in rows:
        if "text" in row:
            text = tokenizer(row["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids, labels = ids + text, labels + text
        else:
            conversation = expected_chat(tokenizer, row["messages"])
            ids, labels = ids + conversation[0], labels + conversation[1]
    input_ids, block_labels = packed(data, tokenizer, block_size=128)
    assert input_ids.shape == (len(ids) // 128, 128)
    assert input_ids.flatten().tolist() == ids[: input_ids.numel()]
    assert block_labels.flatten().tolist() == labels[: input_ids.numel()]
    streamed = packed(data, tokenizer, block_size=128, streaming=True)
    assert torch.equal(streamed[0], input_ids) and torch.equal(streamed[1], block_labels)


def test_blocks_without_a_label_to_train_on_are_left_out(tmp_path):
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    prompt = stdlib_text("textwrap.py", chars=10 * 32)  # ten blocks of prompt, then the answer in two or three
    conversation = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "x" * 70}]
    data = write(tmp_path / "chat.parquet", [{"messages": conversation}])
    ids, labels = expected_chat(tokenizer, conversation)
    input_ids, block_labels = packed(data, tokenizer, block_size=32)
    kept = [start for start in range(0, len(ids) - 31, 32) if set(labels[start + 1 : start + 32]) != {IGNORE_INDEX}]
    assert 2 <= len(kept) < len(ids) // 32 and input_ids.tolist() == [ids[start : start + 32] for start in kept]
    assert block_labels.tolist() == [labels[start : start + 32] for start in kept]


def test_streaming_reads_only_the_blocks_asked_for(tmp_path):
    write(tmp_path / "a.jsonl", [{"text": text} for text in DOCUMENTS])
    write(tmp_path / "b.jsonl", [{"text": 7}])  # read only if the blocks of a.jsonl are not enough
    whole = text_blocks(DOCUMENTS)
    for streaming in (False, True):
        [source, _] = load_data(tmp_path, streaming=streaming)
        assert isinstance(source.rows, IterableDataset) == streaming
        input_ids, labels = packed(tmp_path, max_blocks=5, streaming=streaming)
        assert torch.equal(input_ids, whole[:5]) and torch.equal(labels, whole[:5])
        with pytest.raises(DualFlowUserError, match='b.jsonl, row 0: field "text" holds int, not a string'):
            packed(tmp_path, streaming=streaming)


def test_blocks_for_steps_leave_enough_training_blocks_after_the_hold_out():
    for steps, batch, fraction in [(1, 1, 0.1), (3, 8, 0.1), (10, 4, 0.5), (7, 3, 0.9), (100, 16, 0.01)]:
        needed = blocks_for_steps(steps, batch, fraction)
        train, _ = split_blocks(torch.arange(needed), fraction)
        assert steps * batch <= len(train) <= steps * batch + 3 / (1 - fraction)


BAD_DATA = {}


def bad_data(case):
    """Register `case`: it writes bad data into a folder and gives (the data, load_data options, the message)."""
    BAD_DATA[case.__name__] = case
    return case


@bad_data
def a_row_without_the_field(tmp):
    data = write(tmp / "a.jsonl", [{"text": "fine"}, {"body": "no text"}])
    return data, {}, f'data file {data}, row 1: no "text" field (nor "messages"); its fields: body'


@bad_data
def a_file_without_the_field(tmp):
    data = write(tmp / "a.parquet", [{"content": "x"}])
    return (
        data,
        {"text_field": "body"},
        f'data file {data}, row 0: no "body" field (nor "messages"); its fields: content',
    )


@bad_data
def numbers(tmp):
    data = write(tmp / "a.csv", [{"text": 12}, {"text": 13}])
    return data, {}, f'data file {data}, row 0: field "text" holds int, not a string'


@bad_data
def a_string_then_a_number(tmp):
    (tmp / "a.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    return tmp / "a.jsonl", {}, f'data file {tmp / "a.jsonl"}, row 1: field "text" holds int, not a string'


@bad_data
def a_string_then_a_number_after_a_blank_line(tmp):
    (tmp / "a.jsonl").write_text('{"text": "fine"}\n\n{"text": 3}\n')  # what pyarrow says: datasets' fallback fails
    message = "JSON parse error: Column(/text) changed from string to number in row 1"
    return tmp / "a.jsonl", {}, f"data file {tmp / 'a.jsonl'}: {message}"


@bad_data
def messages_that_are_no_list_of_messages(tmp):
    data = write(tmp / "a.jsonl", [{"messages": ["hello"]}])
    return data, {}, f'data file {data}, row 0: field "messages" is not a list of {{"role": ..., "content": ...}}'


@bad_data
def messages_without_a_chat_template(tmp):
    data = write(tmp / "a.parquet", [{"messages": CONVERSATIONS[1]}])
    return data, {}, f'data file {data}, row 0: the "messages" field needs a chat template, and the tokenizer has none'


@bad_data
def messages_the_chat_template_refuses(tmp):
    data = write(tmp / "a.parquet", [{"messages": CONVERSATIONS[1]}])
    template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    message = 'the chat template fails on "messages": Conversation roles must alternate user/assistant'
    return data, {"chat_template": template}, f"data file {data}, row 0: {message}"


@bad_data
def invalid_json(tmp):
    (tmp / "a.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    return tmp / "a.jsonl", {}, f"data file {tmp / 'a.jsonl'}: JSON parse error: Invalid value. in row 1"


@bad_data
def a_file_that_is_no_parquet(tmp):
    (tmp / "a.parquet").write_text("not parquet")
    message = "Parquet magic bytes not found in footer. Either the file is corrupted or this is not a parquet file."
    return tmp / "a.parquet", {}, f"data file {tmp / 'a.parquet'}: {message}"


@bad_data
def a_txt_file_that_is_no_utf8_text(tmp):
    (tmp / "a.txt").write_bytes(b"caf\xe9")
    return tmp / "a.txt", {}, f"data file {tmp / 'a.txt'} is not UTF-8 text (unexpected end of data at byte 3)"


@bad_data
def a_csv_file_that_is_no_utf8_text(tmp):
    (tmp / "a.csv").write_bytes(b"text\ncaf\xe9 au lait\n")
    return tmp / "a.csv", {}, f"data file {tmp / 'a.csv'}: not UTF-8 text (invalid continuation byte)"


@bad_data
def an_empty_file(tmp):
    (tmp / "a.jsonl").write_text("")
    return tmp / "a.jsonl", {}, f"data file {tmp / 'a.jsonl'}: no rows"


@bad_data
def an_empty_parquet_file(tmp):
    pyarrow.parquet.write_table(pyarrow.table({"text": pyarrow.array([], pyarrow.string())}), tmp / "a.parquet")
    return tmp / "a.parquet", {}, f"data file {tmp / 'a.parquet'}: no rows"


def saved(folder):
    empty = Dataset.from_dict({"text": []}, features=datasets.Features(text=datasets.Value("string")))
    DatasetDict(train=Dataset.from_dict({"text": DOCUMENTS}), validation=empty).save_to_disk(folder)
    return folder


@bad_data
def an_empty_split(tmp):
    data = saved(tmp / "saved")
    return data, {"data_split": "validation"}, f"dataset {data} (split validation): no rows"


@bad_data
def an_unknown_split_of_a_saved_dataset(tmp):
    data = saved(tmp / "saved")
    return data, {"data_split": "test"}, f"dataset {data} has no split 'test' (its splits: train, validation)"


@bad_data
def an_unknown_split_of_a_repository(tmp):
    data = repository(tmp / "repo")
    messages = {  # datasets' own words, which differ when it streams
        False: "Unknown split \"dev\". Should be one of ['train', 'test'].",
        True: "Bad split: dev. Available splits: ['train', 'test']",
    }
    return (
        data,
        {"data_split": "dev"},
        {streaming: f"dataset {data} (split dev): {messages[streaming]}" for streaming in messages},
    )


@bad_data
def an_unknown_config(tmp):
    data = repository(tmp / "repo")
    message = "BuilderConfig 'tiny' not found. Available: ['small', 'large']"
    return data, {"data_config": "tiny"}, f"dataset {data} (config tiny, split train): {message}"


@bad_data
def a_hub_dataset_that_cannot_be_reached(tmp):
    message = "Couldn't reach 'nobody/nothing' on the Hub (OfflineModeIsEnabled)"
    return (
        "nobody/nothing",
        {},
        f"data nobody/nothing (no such file or folder; as a Hub dataset, split train): {message}",
    )


@bad_data
def a_missing_file(tmp):
    return tmp / "corpus.jsonl", {}, f"data file {tmp / 'corpus.jsonl'} does not exist"


@bad_data
def a_file_of_no_data_format(tmp):
    (tmp / "notes.md").write_text("# notes")
    message = (
        "must end in .txt (one document), .jsonl / .json, .parquet, .csv / .tsv or .arrow, or be a folder of such files"
    )
    return tmp / "notes.md", {}, f"data file {tmp / 'notes.md'} {message}"


@bad_data
def a_folder_without_data_files(tmp):
    (tmp / "notes.md").write_text("# notes")
    return tmp, {}, f"data folder {tmp} holds no data file (.txt, .jsonl, .json, .parquet, .csv, .tsv, .arrow)"


@pytest.mark.parametrize("streaming", [False, True], ids=["dataset", "streaming"])
@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_is_a_one_line_error_naming_the_file_row_and_field(tmp_path, capfd, case, streaming):
    data, options, message = BAD_DATA[case](tmp_path)
    tokenizer = ByT5Tokenizer()
    tokenizer.chat_template = options.pop("chat_template", None)
    capfd.readouterr()
    with pytest.raises(DualFlowUserError) as error:
        pack_data(load_data(data, streaming=streaming, **options), tokenizer, BLOCK)
    assert str(error.value) == (message[streaming] if isinstance(message, dict) else message)
    assert capfd.readouterr().err == ""  # nothing but the one line: datasets logs nothing of its own


def test_an_entry_that_reads_as_a_local_path_is_never_tried_on_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for entry in ("data/corpus.parqet", "corpus.jsnol", "corpus.jsonl", str(tmp_path / "corpus")):
        assert not is_hub_dataset_id(entry)
        with pytest.raises(DualFlowUserError, match=f"^data file {re.escape(str(Path(entry)))} does not exist$"):
            load_data(entry)
    # Hub ids: a namespace that is no folder here, or a bare name
    assert is_hub_dataset_id("nobody/nothing") and is_hub_dataset_id("wikitext") and is_hub_dataset_id("user/set.v2")
