"""data: byte-level tokens and the stable stdlib train / validation split."""

import sysconfig
from pathlib import Path

from dualflow.instruments.data import decode_bytes, encode_bytes, split_files, stdlib_source_files


STDLIB = Path(sysconfig.get_paths()["stdlib"])


def test_byte_data_helpers():
    assert decode_bytes(encode_bytes("déf f(x): λ")) == "déf f(x): λ"
    files = stdlib_source_files()
    train, validation = split_files(files)
    assert validation and train and not set(train) & set(validation)
    assert split_files(files) == (train, validation)  # stable
    assert not any("test" in path.relative_to(STDLIB).parts[:-1] for path in files)
