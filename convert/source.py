"""Read-only, lazy view of a source checkpoint folder: its config and its safetensors tensors, one at a time."""

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import CONFIG_MAPPING

from dualflow.checkpoint import download_failure, is_hub_repo_id
from dualflow.errors import DualFlowUserError

from .quantized import SCALE_SUFFIX, source_quantization


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EMBEDDING = "model.embed_tokens.weight"
# A folder from the Hub cache names its repo: .../models--{org}--{name}/snapshots/{revision}
HUB_CACHE_PATH = re.compile(r"models--(?P<org>[^/]+)--(?P<name>[^/]+)/snapshots/[^/]+/?$")
# safetensors dtype codes -> torch dtype names (the float formats checkpoints of these families use).
_TORCH_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Read only from a block-FP8 source, where each such weight comes with its scales.
_FP8_DTYPE_NAMES = {"F8_E4M3": "float8_e4m3fn"}


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

    # model*.safetensors: transformers' own files only (Mistral repos also hold a consolidated.safetensors copy); *.py:
    # a custom tokenizer's code
    patterns = ["*.json", "model*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py", "README.md"]
    try:
        folder = snapshot_download(str(src), revision=revision, token=token, allow_patterns=patterns)
        return Path(folder), str(src)
    except Exception as error:  # huggingface_hub's own messages run to several hundred characters
        raise DualFlowUserError(download_failure(str(src), error)) from error


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype  # of a quantized weight: the dtype it is dequantized to
    scale_key: str | None = None  # of a quantized weight: the key of its scales, and the file holding them
    scale_file: Path | None = None


class SourceCheckpoint:
    """
    Parses `config.json` with transformers' own config class, checks every shard's header before any tensor is read
    (missing, truncated or inconsistent files fail before anything is written), then reads tensors one by one. A
    block-FP8 source is seen dequantized: its weights with their unquantized dtype, without their scale tensors.
    """

    def __init__(self, folder: Path):
        self.folder = folder
        self.config_dict = self._read_config_json()
        self.model_type = self.config_dict.get("model_type")
        self.quantization = source_quantization(self.config_dict)

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
        dtype_names = _TORCH_DTYPE_NAMES | (_FP8_DTYPE_NAMES if self.quantization else {})
        for name in files:
            path = self.folder / name
            if not path.is_file():
                raise DualFlowUserError(f"missing shard {name} (listed in {INDEX_FILE})")
            try:
                with safe_open(path, framework="pt") as handle:
                    for key in handle.keys():
                        tensor_slice = handle.get_slice(key)
                        dtype = getattr(torch, dtype_names[tensor_slice.get_dtype()])
                        tensors[key] = TensorInfo(path, tuple(tensor_slice.get_shape()), dtype)
            except (SafetensorError, OSError) as error:
                raise DualFlowUserError(f"shard {name} is unreadable or truncated: {error}") from error
            except KeyError as error:
                raise DualFlowUserError(f"shard {name} holds a tensor of unsupported dtype {error}") from error
        if weight_map is not None:
            for key, name in weight_map.items():
                if key not in tensors or tensors[key].file.name != name:
                    raise DualFlowUserError(f"{INDEX_FILE} maps {key} to {name}, which does not contain it")
            tensors = {key: tensors[key] for key in weight_map}  # like transformers, trust the index for what exists
        return self._dequantized_view(tensors) if self.quantization else tensors

    @property
    def dtype(self) -> torch.dtype:
        """
        The dtype of the source's unquantized weights: config.json's, or where it names none, the stored embedding's.
        The converted config states it, and a block-FP8 source's weights are dequantized to it.
        """
        return self._unquantized_dtype(self.tensors)

    def _unquantized_dtype(self, tensors: dict[str, TensorInfo]) -> torch.dtype:
        name = self.config_dict.get("dtype") or self.config_dict.get("torch_dtype")
        if name in _TORCH_DTYPE_NAMES.values():
            return getattr(torch, name)
        # transformers' default where there is no embedding either; the conversion then stops at the missing tensor
        return tensors[EMBEDDING].dtype if EMBEDDING in tensors else torch.float32

    def _dequantized_view(self, tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
        """Each float8 weight paired with its scales (checked), which are not tensors of the model."""
        view, dtype = {}, self._unquantized_dtype(tensors)
        for key, info in tensors.items():
            scale_key = key + SCALE_SUFFIX
            if info.dtype != torch.float8_e4m3fn:
                if key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) in tensors:
                    continue  # checked with its weight
                if scale_key in tensors:
                    raise DualFlowUserError(f"{scale_key} scales {key}, which is {info.dtype} rather than float8")
                view[key] = info
                continue
            if scale_key not in tensors:
                raise DualFlowUserError(f"{key} is float8 but the checkpoint has no {scale_key}")
            expected = self.quantization.scale_shape(info.shape)
            if tensors[scale_key].shape != expected:
                raise DualFlowUserError(
                    f"{scale_key} has shape {list(tensors[scale_key].shape)}, expected {list(expected)} for "
                    f"{key} of shape {list(info.shape)} in blocks of {self.quantization.block_size}"
                )
            scale_file = tensors[scale_key].file
            view[key] = TensorInfo(info.file, info.shape, dtype, scale_key, scale_file)
        return view

    def info(self, key: str) -> TensorInfo:
        if key not in self.tensors:
            where = INDEX_FILE if (self.folder / INDEX_FILE).is_file() else SINGLE_FILE
            raise DualFlowUserError(f"tensor {key} is missing from {where}")
        return self.tensors[key]

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor; a quantized weight dequantized to its `info(key).dtype`."""
        info = self.info(key)
        if info.scale_key is not None:
            return torch.cat(list(self.read_pieces(key))).reshape(info.shape).to(info.dtype)
        # One short-lived handle per read: the shard's memory map is released right away, so pages touched by
        # earlier reads never accumulate in the resident set.
        with safe_open(info.file, framework="pt") as handle:
            return handle.get_tensor(key)

    def read_pieces(self, key: str) -> Iterator[torch.Tensor]:
        """
        The tensor in pieces to concatenate in C order: the whole tensor, or for a quantized weight its float32
        dequantization one block of rows at a time (never the whole weight in float32).
        """
        info = self.info(key)
        if info.scale_key is None:
            yield self.read(key)
            return
        with safe_open(info.scale_file, framework="pt") as handle:
            scale_inv = handle.get_tensor(info.scale_key)
        with safe_open(info.file, framework="pt") as handle:
            yield from self.quantization.dequantized_rows(handle.get_slice(key), scale_inv)
