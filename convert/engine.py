"""The streaming conversion engine: plan every output tensor from the source headers, then write shards piece by piece.

Planning reads no tensor data (except the tied-embedding check): it knows each output tensor's name, shape, dtype and
the source tensors it is made of, so every error about the source surfaces before the first byte is written. Writing
reads one source tensor at a time (a block-FP8 weight: one block of rows at a time, dequantized) and appends it to the
output file at once; peak memory is about the largest single source tensor (usually the embedding matrix), whatever
the model or shard size.
"""

import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import split_state_dict_into_shards_factory
from tqdm.auto import tqdm

from dualflow.errors import DualFlowUserError
from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM

from .families import Family
from .safetensors_writer import StreamingSafetensorsWriter
from .source import EMBEDDING, INDEX_FILE, SourceCheckpoint


LAYER_NAME = re.compile(r"^(?P<prefix>model\.layers\.\d+\.)(?P<local>.+)$")
LM_HEAD = "lm_head.weight"
FUSED_EXPERT_NAMES = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# Buffers some older checkpoints still carry; the model recomputes them.
IGNORED_SOURCE_TENSORS = re.compile(r"rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class Piece:
    """
    A source tensor making up a C-order slice of an output tensor; when `key` is None, zeros, or with `std` > 0 a
    N(0, std^2) draw seeded by `seed` (the same conversion always writes the same tensor).
    """

    key: str | None
    shape: tuple[int, ...]
    std: float = 0.0
    seed: int = 0

    def fresh(self) -> torch.Tensor:
        if not self.std:
            return torch.zeros(self.shape)
        return torch.randn(self.shape, generator=torch.Generator().manual_seed(self.seed)) * self.std


@dataclass(frozen=True)
class TargetTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def _expert_pieces(local: str, prefix: str, family: Family, config: DualFlowConfig, shape) -> list[Piece]:
    """Pieces of a routed-expert tensor read from the per-expert Hub layout."""
    names, hidden, inner = family.experts, config.hidden_size, config.moe_intermediate_size
    if local == "mlp.gate.weight":
        return [Piece(prefix + names.router, shape)]
    if local == "mlp.experts.gate_up_proj":  # (E, 2I, H): expert e's gate rows, then its up rows
        return [
            Piece(prefix + name.format(e=e), (inner, hidden))
            for e in range(config.num_experts)
            for name in (names.gate, names.up)
        ]
    return [Piece(prefix + names.down.format(e=e), (hidden, inner)) for e in range(config.num_experts)]


# The upcycling init, with which the aux flow computes exactly the primary one (at k_a = k_p): the aux embedding a
# copy of the primary one; no coupling, extra aux rounds as the identity, aux adapters adding nothing.
AUX_EMBEDDING = "model.aux_embed_tokens.weight"
ZERO_AT_UPCYCLING = (".aux_coupling.weight", ".aux_round_gate.weight", "_adapter.up")


@torch.no_grad()
def init_aux_from_primary(model: DualFlowForCausalLM) -> DualFlowForCausalLM:
    """The upcycling init, in place, on a model in memory (what `convert_checkpoint` writes). Returns the model."""
    parameters = dict(model.named_parameters())
    parameters[AUX_EMBEDDING].copy_(parameters[EMBEDDING])
    for name, parameter in parameters.items():
        if name.endswith(ZERO_AT_UPCYCLING):
            parameter.zero_()  # an adapter's `down` keeps its random draw, or the adapter could never learn
    return model


def _pieces_for(name: str, shape, source: SourceCheckpoint, family: Family, config: DualFlowConfig) -> list[Piece]:
    if name == AUX_EMBEDDING:
        return [Piece(EMBEDDING, shape)]
    if name.endswith(ZERO_AT_UPCYCLING):
        return [Piece(None, shape)]
    if name.endswith("_adapter.down"):  # random, as at initialisation: with `up` = 0 a zero `down` would never train
        return [Piece(None, shape, std=config.initializer_range, seed=zlib.crc32(name.encode()))]
    match = LAYER_NAME.match(name)
    if match and family.experts and match["local"] in FUSED_EXPERT_NAMES:
        fused_in_source = match["prefix"] + "mlp.experts.gate_up_proj" in source.tensors
        if not fused_in_source:
            return _expert_pieces(match["local"], match["prefix"], family, config, shape)
    return [Piece(name, shape)]


def _check_tied_embeddings(source: SourceCheckpoint, config: DualFlowConfig) -> set[str]:
    """Source keys accounted for by the tie; errors when the config and the tensors disagree."""
    if not config.tie_word_embeddings:
        if LM_HEAD not in source.tensors:
            raise DualFlowUserError(f"config.json has tie_word_embeddings=false but the checkpoint has no {LM_HEAD}")
        return set()
    if LM_HEAD not in source.tensors:
        return set()
    if not torch.equal(source.read(LM_HEAD), source.read(EMBEDDING)):
        raise DualFlowUserError(
            f"config.json has tie_word_embeddings=true but {LM_HEAD} differs from {EMBEDDING}; refusing to tie them"
        )
    return {LM_HEAD}


# The config.json fields tensor shapes follow; transformers fills in a default for a missing one.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_local_experts",
    "num_experts",
)


def _missing_size_fields(source: SourceCheckpoint) -> str:
    """For a shape error: the size fields config.json lacks, whose defaults made the expected shape."""
    parsed = source.parse_config()
    # A field may be written under another name the config class maps to it (Mixtral's num_local_experts).
    aliases = {name: {name} for name in SIZE_FIELDS}
    for alias, target in getattr(parsed, "attribute_map", {}).items():
        for names in (aliases.get(alias), aliases.get(target)):
            if names is not None:
                names.update((alias, target))
    missing = [name for name in SIZE_FIELDS if hasattr(parsed, name) and not aliases[name] & source.config_dict.keys()]
    if not missing:
        return ""
    defaults = ", ".join(f"{name}={getattr(parsed, name)}" for name in missing)
    return f", which has no {' / '.join(missing)} (transformers' defaults used: {defaults})"


def plan_targets(
    source: SourceCheckpoint, family: Family, config: DualFlowConfig, dtype: torch.dtype | None
) -> list[TargetTensor]:
    """Every tensor of the Dual-Flow state dict, in the model's own order, with the source tensors it is built from."""
    with torch.device("meta"):  # names and shapes exactly as DualFlowForCausalLM expects them, no memory
        expected = DualFlowForCausalLM(config).state_dict()
    if config.tie_word_embeddings:
        expected.pop(LM_HEAD, None)
    consumed = _check_tied_embeddings(source, config)
    default_dtype = dtype or source.info(EMBEDDING).dtype
    targets = []
    for name, meta_tensor in expected.items():
        shape = tuple(meta_tensor.shape)
        pieces = _pieces_for(name, shape, source, family, config)
        for piece in pieces:
            if piece.key is None:
                continue
            found = source.info(piece.key).shape
            if found != piece.shape:
                raise DualFlowUserError(
                    f"{piece.key} has shape {list(found)}, expected {list(piece.shape)} from config.json"
                    f"{_missing_size_fields(source)}"
                )
            consumed.add(piece.key)
        first_key = pieces[0].key
        target_dtype = dtype or (source.info(first_key).dtype if first_key else default_dtype)
        targets.append(TargetTensor(name, shape, target_dtype, tuple(pieces)))
    unused = sorted(key for key in source.tensors if key not in consumed and not IGNORED_SOURCE_TENSORS.search(key))
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise DualFlowUserError(
            f"the checkpoint has tensors a {source.model_type} model of this config does not use: "
            f"{', '.join(unused[:3])}{more}"
        )
    return targets


def write_checkpoint(
    targets: list[TargetTensor], source: SourceCheckpoint, out_dir: Path, max_shard_size: int, show_progress: bool
) -> dict:
    """Write `targets` as safetensors shards (+ index when more than one) into `out_dir`; returns a summary."""
    split = split_state_dict_into_shards_factory(
        {target.name: target for target in targets},
        get_storage_size=lambda target: target.nbytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )
    by_name = {target.name: target for target in targets}
    with tqdm(total=len(targets), unit="tensor", desc="Converting", disable=not show_progress) as progress:
        for filename, names in split.filename_to_tensors.items():
            layout = [(name, by_name[name].dtype, by_name[name].shape) for name in names]
            with StreamingSafetensorsWriter(out_dir / filename, layout, metadata={"format": "pt"}) as writer:
                for name in names:
                    target = by_name[name]
                    for piece in target.pieces:
                        for data in source.read_pieces(piece.key) if piece.key else [piece.fresh()]:
                            writer.write(data.to(target.dtype))
                            del data  # release before reading the next piece
                    progress.update()
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {
        "num_tensors": len(targets),
        "num_shards": len(split.filename_to_tensors),
        "total_bytes": split.metadata["total_size"],
    }
