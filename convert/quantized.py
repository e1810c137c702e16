"""Quantized sources: which `quantization_config` the converter reads, and how it dequantizes those weights.

Block FP8 (`quant_method: fp8` with a `weight_block_size`, as in the FP8 releases of Qwen3 and DeepSeek-V3) stores a
quantized weight `W` as float8_e4m3fn values `Q` and a float32 `{name}_scale_inv` with one scale per block of
`block_size` = (rows, columns), counted from the first row and column; the blocks on the last rows and columns may be
partial. The weight is `W[r, c] = Q[r, c] * scale_inv[r // rows, c // columns]`, computed in float32. Everything else
(the router, norms, embeddings, the LM head) is stored unquantized and has no scale.
"""

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dualflow.errors import DualFlowUserError


SCALE_SUFFIX = (
    "_scale_inv"  # `x.weight` -> `x.weight_scale_inv`, a fused `x.gate_up_proj` -> `x.gate_up_proj_scale_inv`
)
REFUSAL_ADVICE = "convert the unquantized (bf16 or fp32) release of the model instead"
# Block-FP8 settings that change what the tensors mean, with the one value the converter reads.
FP8_SETTINGS = {"activation_scheme": "dynamic", "scale_fmt": "float", "expert_dtype": "fp8", "fmt": "e4m3"}


@dataclass(frozen=True)
class BlockFP8:
    block_size: tuple[int, int]

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the scales of a weight of `shape`: one per (possibly partial) block of its last two dims."""
        rows, columns = shape[-2:]
        return (*shape[:-2], math.ceil(rows / self.block_size[0]), math.ceil(columns / self.block_size[1]))

    def splits_unevenly(self, shape: tuple[int, ...]) -> bool:
        """Whether a weight of `shape` has a partial block after a whole one (in rows or columns)."""
        return any(size > block and size % block for size, block in zip(shape[-2:], self.block_size))

    def dequantized_rows(self, weight_slice, scale_inv: torch.Tensor) -> Iterator[torch.Tensor]:
        """
        The float32 weight, one block of rows at a time in C order, read from a safetensors slice of the float8
        weight: only one block of rows is ever in memory.
        """
        shape = tuple(weight_slice.get_shape())
        rows, columns = shape[-2:]
        block_rows, block_columns = self.block_size
        for leading in itertools.product(*map(range, shape[:-2])):  # the expert index of a fused (E, N, K) tensor
            for block, start in enumerate(range(0, rows, block_rows)):
                values = weight_slice[(*leading, slice(start, start + block_rows))].to(torch.float32)
                scales = scale_inv[(*leading, block)].to(torch.float32).repeat_interleave(block_columns)
                yield values.mul_(scales[:columns])


def source_quantization(config_dict: dict) -> BlockFP8 | None:
    """The quantization of a source from its config.json: None when unquantized; anything but block FP8 is refused."""
    quantization = config_dict.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else "unknown"
    if method != "fp8":
        raise DualFlowUserError(
            f"{method} quantized checkpoints are not supported (only block FP8 is, dequantized): {REFUSAL_ADVICE}"
        )
    block_size = quantization.get("weight_block_size")
    if block_size is None:
        raise DualFlowUserError(
            f"fp8 checkpoints without weight_block_size (per-tensor scales) are not supported: {REFUSAL_ADVICE}"
        )
    valid = isinstance(block_size, list | tuple) and len(block_size) == 2
    if not valid or not all(isinstance(size, int) and size > 0 for size in block_size):
        raise DualFlowUserError(f"fp8 weight_block_size must be two positive integers, got {block_size!r}")
    for name, supported in FP8_SETTINGS.items():
        value = quantization.get(name, supported)
        if value != supported:
            raise DualFlowUserError(
                f"fp8 checkpoints with {name}={value!r} are not supported (only {supported!r}): {REFUSAL_ADVICE}"
            )
    return BlockFP8(tuple(block_size))
