"""Read-only, lazy view of a source checkpoint folder: its config and its safetensors tensors, one at a time."""

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import CONFIG_MAPPING

from dualflow.checkpoint import download_failure, is_hub_repo_id
from dualflow.errors import DualFlowUserError


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# A folder from the Hub cache names its repo: .../models--{org}--{name}/snapshots/{revision}
HUB_CACHE_PATH = re.compile(r"models--(?P<org>[^/]+)--(?P<name>[^/]+)/snapshots/[^/]+/?$")
# safetensors dtype codes -> torch dtype names (the float formats checkpoints of these families use).
_TORCH_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def resolve_source(src: str | Path, revision: str | None = None, token: str | None = None) -> tuple[Path, str | None]:
    """
    Local folder for `src` and the Hub repo id it comes from (None if unknown); downloads Hub ids (at `revision`, a
    branch, tag or commit, with `token` for private or gated repos).
    """
    path = Path(src).expanduser()
    if path.is_dir():
        if revision is not None:
            raise DualFlowUserError(f"--revision applies to Hub sources; {src} is a local folder")
        match = HUB_CACHE_PATH.search(path.resolve().as_posix())
        return path, f"{match['org']}/{match['name']}" if match else None
    if path.exists():
        raise DualFlowUserError(f"source {src} is a file; pass the checkpoint folder")
    if not is_hub_repo_id(str(src)):
        raise DualFlowUserError(f"source folder {src} does not exist")
    from huggingface_hub import snapshot_download

    # model*.safetensors: transformers' own files only (Mistral repos also hold a consolidated.safetensors copy)
    patterns = ["*.json", "model*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "README.md"]
    try:
        folder = snapshot_download(str(src), revision=revision, token=token, allow_patterns=patterns)
        return Path(folder), str(src)
    except Exception as error:  # huggingface_hub's own messages run to several hundred characters
        raise DualFlowUserError(download_failure(str(src), error)) from error


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


class SourceCheckpoint:
    """
    Parses `config.json` with transformers' own config class, checks every shard's header before any tensor is read
    (missing, truncated or inconsistent files fail before anything is written), then reads tensors one by one.
    """

    def __init__(self, folder: Path):
        self.folder = folder
        self.config_dict = self._read_config_json()
        self.model_type = self.config_dict.get("model_type")

    def _read_config_json(self) -> dict:
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise DualFlowUserError(f"{self.folder} has no config.json")
        try:
            config_dict = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise DualFlowUserError(f"{config_path} is not valid JSON: {error}") from error
        if not isinstance(config_dict, dict) or "model_type" not in config_dict:
            raise DualFlowUserError(f"{config_path} has no model_type")
        return config_dict

    def parse_config(self):
        """The source config as transformers itself reads it (defaults filled, legacy fields standardised)."""
        if self.config_dict.get("quantization_config"):
            raise DualFlowUserError("quantized checkpoints (config.json has quantization_config) are not supported")
        try:
            return CONFIG_MAPPING[self.model_type].from_dict(self.config_dict)
        except Exception as error:  # strict dataclass validation raises several types; all mean a bad config.json
            message = " ".join(line.strip() for line in str(error).splitlines()) or type(error).__name__
            raise DualFlowUserError(f"invalid {self.folder / 'config.json'}: {message}") from error

    @cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        """Name -> file, shape, dtype of every tensor, from the shard headers (scanned on first use)."""
        index_path = self.folder / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise DualFlowUserError(f"{index_path} is not a valid safetensors index: {error}") from error
            files = sorted(set(weight_map.values()))
        elif (self.folder / SINGLE_FILE).is_file():
            weight_map, files = None, [SINGLE_FILE]
        else:
            found = sorted(p.name for p in self.folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
            hint = f" (found {', '.join(found)}; only safetensors are read)" if found else ""
            raise DualFlowUserError(f"{self.folder} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")

        tensors = {}
        for name in files:
            path = self.folder / name
            if not path.is_file():
                raise DualFlowUserError(f"missing shard {name} (listed in {INDEX_FILE})")
            try:
                with safe_open(path, framework="pt") as handle:
                    for key in handle.keys():
                        tensor_slice = handle.get_slice(key)
                        dtype = getattr(torch, _TORCH_DTYPE_NAMES[tensor_slice.get_dtype()])
                        tensors[key] = TensorInfo(path, tuple(tensor_slice.get_shape()), dtype)
            except (SafetensorError, OSError) as error:
                raise DualFlowUserError(f"shard {name} is unreadable or truncated: {error}") from error
            except KeyError as error:
                raise DualFlowUserError(f"shard {name} holds a tensor of unsupported dtype {error}") from error
        if weight_map is None:
            return tensors
        for key, name in weight_map.items():
            if key not in tensors or tensors[key].file.name != name:
                raise DualFlowUserError(f"{INDEX_FILE} maps {key} to {name}, which does not contain it")
        return {key: tensors[key] for key in weight_map}  # like transformers, trust the index for what exists

    def info(self, key: str) -> TensorInfo:
        if key not in self.tensors:
            where = INDEX_FILE if (self.folder / INDEX_FILE).is_file() else SINGLE_FILE
            raise DualFlowUserError(f"tensor {key} is missing from {where}")
        return self.tensors[key]

    def read(self, key: str) -> torch.Tensor:
        # One short-lived handle per read: the shard's memory map is released right away, so pages touched by
        # earlier reads never accumulate in the resident set.
        with safe_open(self.info(key).file, framework="pt") as handle:
            return handle.get_tensor(key)
