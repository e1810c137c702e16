"""
Which `--data` entries are local paths and which are Hub dataset ids, decided without importing `datasets` (or torch),
so that `dualflow finetune` refuses a mistyped local path at once instead of trying it on the Hub.
"""

import re
from pathlib import Path

from .errors import DualFlowUserError


# Suffix -> the datasets builder that reads such a file into rows, and its options. A .txt file is one document.
FILE_FORMATS = {
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".parquet": ("parquet", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"sep": "\t"}),
    ".arrow": ("arrow", {}),
}
DATA_SUFFIXES = (".txt", *FILE_FORMATS)
HUB_ID = re.compile(r"\w[\w.-]*(/\w[\w.-]*)?")
# What a file name ends with (".parqet", ".jsnol"): a Hub id without a namespace ("wikitext") has no such ending.
FILE_NAME_ENDING = re.compile(r"\.[A-Za-z]\w{0,7}")


def is_hub_dataset_id(entry) -> bool:
    """
    Whether a `--data` entry that names nothing on disk is to be read as a Hub dataset id: it has the form of one, and
    neither ends like a file name (a misspelled suffix included) nor sits in a folder that exists here.
    """
    path = Path(entry)
    if path.exists() or not HUB_ID.fullmatch(str(entry)) or path.suffix in DATA_SUFFIXES:
        return False
    if "/" in str(entry):  # namespace/name: a local path when the namespace is a folder here
        return not path.parent.is_dir()
    return not FILE_NAME_ENDING.fullmatch(path.suffix)  # a bare name: a local path when it ends like a file name


def check_local_data(entries) -> None:
    """Refuse the first entry that is meant as a local path (`is_hub_dataset_id` is false) but is not there."""
    for entry in entries:
        if not Path(entry).exists() and not is_hub_dataset_id(entry):
            raise DualFlowUserError(f"data file {Path(entry)} does not exist")
