"""
A Dual-Flow checkpoint -> the same checkpoint in compressed-tensors W4A8 on the attention projections, the
quantised format vLLM serves it in (`dualflow quantize`). compressed-tensors' own pieces do the work: its
`W4A8` preset (int4 weights in groups of 128, symmetric; int8 activations quantised per token at run time),
its scale computation and its int compressor, run over the safetensors files by its model-free
`convert_checkpoint` (one file in memory at a time), which also copies the other files and writes the
`quantization_config`.

Only the attention projections are quantised: vLLM's CPU build has no kernel for quantised experts on x86
without AMX, so the experts stay as they are, and so do the router, the embeddings, `lm_head` and every module
of the aux flow (its embedding, couplings, round gates and adapters). The ignore list names them all, so that
a tool matching modules by class leaves them alone too.
"""

import json
from pathlib import Path

import torch
from compressed_tensors.compressors import IntQuantizationCompressor
from compressed_tensors.config import CompressionFormat
from compressed_tensors.entrypoints.convert import convert_checkpoint
from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from compressed_tensors.utils.match import match_quantizable_tensors

from .errors import DualFlowUserError
from .output_folder import check_output_folder, output_folder, unfinished_run


SCHEME = "W4A8"
ATTENTION_PROJECTIONS = r"re:.*\.self_attn\.(q|k|v|o)_proj$"
IGNORE = [
    "lm_head",
    r"re:.*embed_tokens$",  # the aux embedding too
    r"re:.*\.aux_.*",  # the aux flow's couplings, round gates and adapters
    r"re:.*\.mlp\.gate$",  # the router
    r"re:.*\.mlp\.experts.*",
    r"re:.*\.shared_expert.*",
]
# Fields of a quantization_config that do not change what is computed: the library version that wrote it.
UNCOMPARED_FIELDS = {"version"}


def served_quantization_config() -> QuantizationConfig:
    """The one quantisation served: compressed-tensors' W4A8 preset on the attention projections."""
    scheme = preset_name_to_scheme(SCHEME, [ATTENTION_PROJECTIONS])
    scheme.format = CompressionFormat.int_quantized
    return QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=IGNORE,
        format=CompressionFormat.int_quantized.value,
        quantization_status=QuantizationStatus.COMPRESSED,
    )


def first_difference(expected, found, path: str) -> tuple[str, object] | None:
    """The first dotted field where `found` (a config.json section) differs from `expected`, and its value."""
    if not (isinstance(expected, dict) and isinstance(found, dict)):
        return None if expected == found else (path, found)
    for key in sorted((expected.keys() | found.keys()) - UNCOMPARED_FIELDS):
        difference = first_difference(expected.get(key), found.get(key), f"{path}.{key}")
        if difference is not None:
            return difference
    return None


def unserved_field(quantization_config: dict | None) -> tuple[str, object] | None:
    """Where a checkpoint's `quantization_config` departs from `dualflow quantize`'s (None: nowhere)."""
    expected = json.loads(served_quantization_config().model_dump_json())
    return first_difference(expected, quantization_config, "quantization_config")


class AttentionW4A8:
    """
    A compressed-tensors `Converter` (its model-free conversion calls it on each safetensors file's tensors):
    each attention projection's weight becomes int4 values stored as int8, one scale per group of 128 inputs.
    """

    def __init__(self):
        self.config = served_quantization_config()
        (self.scheme,) = self.config.config_groups.values()

    def process(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for module, name in list(match_quantizable_tensors(tensors, self.config.ignore, self.scheme.targets)):
            weight = tensors.pop(name)
            scale, zero_point = compute_dynamic_scales_and_zp(weight, self.scheme.weights, module=None)
            # vLLM's CPU kernel holds group scales in bfloat16: so rounded, dequantising gives what it serves
            scale = scale.to(torch.bfloat16).to(weight.dtype)
            state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
            for key, value in IntQuantizationCompressor.compress(state, self.scheme).items():
                tensors[f"{module}.{key}"] = value
        return tensors

    def validate(self, tensors: dict[str, torch.Tensor]) -> None:
        """The shapes were checked on the config (`check_source`), before any file was written."""

    def create_config(self) -> QuantizationConfig:
        return self.config

    def get_dependencies(self, weight_name: str) -> set[str]:
        return set()  # each weight is quantised on its own


def check_source(src: Path) -> dict:
    """One-line errors for a SRC that is not an unquantised Dual-Flow checkpoint W4A8 fits; its config."""
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise DualFlowUserError(
            f"{src} has no readable config.json ({error}): give a Dual-Flow checkpoint folder"
        ) from None
    if config.get("model_type") != "dualflow":
        raise DualFlowUserError(
            f"{src} is a {config.get('model_type')!r} checkpoint, not a Dual-Flow one: convert it first "
            "(`dualflow convert`)"
        )
    if unfinished_run(src) is not None:
        raise DualFlowUserError(f"{src} holds a run that did not finish: give a complete checkpoint")
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method")
        raise DualFlowUserError(f"{src} is already quantised ({method}): give the unquantised checkpoint")
    group_size = served_quantization_config().config_groups["group_0"].weights.group_size
    inputs = {
        "q/k/v_proj (hidden_size)": config["hidden_size"],
        "o_proj (num_attention_heads x head_dim)": config["num_attention_heads"] * config["head_dim"],
    }
    for projection, size in inputs.items():
        if size % group_size:
            raise DualFlowUserError(
                f"{SCHEME} quantises in groups of {group_size} inputs, and {projection} has {size}: "
                "this checkpoint cannot be quantised so"
            )
    return config


def quantize_checkpoint(src, out, overwrite: bool = False) -> dict:
    """
    Write the Dual-Flow checkpoint folder `src` to `out` with its attention projections in compressed-tensors
    W4A8, the rest as it is. `out` is written as `dualflow convert` writes its output (absent or empty unless
    `overwrite`, nothing left on failure). Returns a summary: the folder, quantised projections, bytes.
    """
    src, out = Path(src), Path(out)
    config = check_source(src)
    if out.resolve().is_relative_to(src.resolve()) or src.resolve().is_relative_to(out.resolve()):
        raise DualFlowUserError(f"OUT {out} and SRC {src} overlap: choose an output folder outside SRC")
    check_output_folder(out, "quantize", replace=overwrite)
    with output_folder(out, "quantize", replace=overwrite) as folder:
        convert_checkpoint(src, folder.path, AttentionW4A8())
        index_path = folder.path / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        if not (src / index_path.name).is_file():  # compressed-tensors indexes a single file too: keep SRC's layout
            index_path.unlink()
    quantised = [name for name in index["weight_map"] if name.endswith(".weight_scale")]
    return {
        "out": out,
        "num_quantised": len(quantised),
        "num_layers": config["num_hidden_layers"],
        "total_bytes": index["metadata"]["total_size"],
    }
