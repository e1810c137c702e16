"""`convert_checkpoint`: upcycle a transformers checkpoint into a Hub-ready Dual-Flow checkpoint folder."""

import shlex
import shutil
from pathlib import Path

import torch
from transformers.utils.hub import convert_file_size_to_int

import modeling_dualflow
from dualflow.checkpoint import TOKENIZER_PATTERNS, auto_map_code_files
from dualflow.errors import DualFlowUserError
from dualflow.model_card import license_of, write_model_card
from dualflow.output_folder import check_output_folder, output_folder
from modeling_dualflow import DualFlowConfig

from . import DTYPE_NAMES
from .engine import plan_targets, write_checkpoint
from .families import family_for
from .source import SourceCheckpoint, resolve_source
from .verify import check_parity


DTYPES = {name: None if name == "auto" else getattr(torch, name) for name in DTYPE_NAMES}
# The files a remote-code load of the checkpoint imports (modeling_dualflow.py imports the other two).
AUTO_MAP = {
    "AutoConfig": "configuration_dualflow.DualFlowConfig",
    "AutoModel": "modeling_dualflow.DualFlowModel",
    "AutoModelForCausalLM": "modeling_dualflow.DualFlowForCausalLM",
}


def build_config(
    source: SourceCheckpoint,
    aux_top_k: int | None,
    dtype: torch.dtype | None,
    aux_rounds: int = 1,
    aux_adapter_rank: int = 0,
) -> DualFlowConfig:
    family = family_for(source.model_type)
    fields = family.dualflow_config_fields(source.parse_config())
    if aux_rounds < 1:
        raise DualFlowUserError(f"--aux-rounds must be >= 1, got {aux_rounds}")
    hidden_size = fields["hidden_size"]
    if not 0 <= aux_adapter_rank <= hidden_size:  # a rank above the width adds weights and nothing it can express
        raise DualFlowUserError(
            f"--aux-adapter-rank must be in [0, hidden_size={hidden_size}] (0 = no adapters), got {aux_adapter_rank}"
        )
    # The upcycling init the engine writes (aux embedding = primary, closed round gates), stated in the config too.
    fields |= {"aux_num_rounds": aux_rounds, "aux_adapter_rank": aux_adapter_rank}
    fields |= {"aux_embed_init": "copy", "aux_round_gate_init": 0.0}
    num_experts = fields.get("num_experts", 0)
    if aux_top_k is not None:
        if not num_experts:
            raise DualFlowUserError(f"--aux-top-k applies to MoE models; {source.model_type} is dense")
        if not 1 <= aux_top_k <= num_experts:
            raise DualFlowUserError(f"--aux-top-k must be in [1, num_experts={num_experts}], got {aux_top_k}")
        fields["aux_num_experts_per_tok"] = aux_top_k
    try:
        config = DualFlowConfig(**fields)
    except ValueError as error:
        raise DualFlowUserError(
            f"{source.model_type} config cannot be expressed as a Dual-Flow config: {error}"
        ) from error
    config.architectures = ["DualFlowForCausalLM"]
    config.auto_map = dict(AUTO_MAP)
    config.dtype = dtype or source.dtype
    return config


def conversion_command(
    src, out, aux_top_k, dtype_name, max_shard_size, verify, aux_rounds=1, aux_adapter_rank=0, revision=None
) -> str:
    """The `dualflow convert` command line equivalent to this call, as the model card records it (no token)."""
    words = ["dualflow", "convert", str(src), str(out)]
    if revision is not None:
        words += ["--revision", revision]
    if aux_top_k is not None:
        words += ["--aux-top-k", str(aux_top_k)]
    if aux_rounds != 1:
        words += ["--aux-rounds", str(aux_rounds)]
    if aux_adapter_rank:
        words += ["--aux-adapter-rank", str(aux_adapter_rank)]
    if dtype_name not in (None, "auto"):
        words += ["--dtype", dtype_name]
    if str(max_shard_size) != "5GB":
        words += ["--max-shard-size", str(max_shard_size)]
    if verify:
        words.append("--verify")
    return shlex.join(words)


def _copy_passthrough_files(src_dir: Path, out_dir: Path, tokenizer_code: list[str]) -> list[str]:
    """The tokenizer's files, and `tokenizer_code` (what its own auto_map names), copied unless OUT has one."""
    paths = [path for pattern in TOKENIZER_PATTERNS for path in sorted(src_dir.glob(pattern))]
    copied = []
    for path in paths + [src_dir / name for name in tokenizer_code]:
        if path.is_file() and not (out_dir / path.name).exists():
            shutil.copy2(path, out_dir / path.name)
            copied.append(path.name)
    return copied


def _card_parity(parity: dict | None) -> dict | None:
    """Parity figures as the model card shows them."""
    if parity is None:
        return None
    aux = f"{parity['max_abs_diff_aux']:.3g}"
    if not parity["aux_compared"]:
        aux += " (k_a != k_p: the aux flow is meant to differ)"
    return {**parity, "max_abs_diff_aux": aux, "max_abs_diff_primary": f"{parity['max_abs_diff_primary']:.3g}"}


def _check_verifiable(source: SourceCheckpoint):
    """--verify runs the source dequantized by transformers, which reads FP8 blocks right only where they divide."""
    if source.quantization is None:
        return
    for key, info in source.tensors.items():
        if info.scale_key is not None and source.quantization.splits_unevenly(info.shape):
            raise DualFlowUserError(
                f"--verify cannot check this FP8 source: {key} of shape {list(info.shape)} ends in partial "
                f"{source.quantization.block_size} blocks, which transformers dequantizes with other blocks; "
                "convert without --verify"
            )


def convert_checkpoint(
    src: str | Path,
    out: str | Path,
    aux_top_k: int | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    verify: bool = False,
    overwrite: bool = False,
    show_progress: bool = True,
    aux_rounds: int = 1,
    aux_adapter_rank: int = 0,
    revision: str | None = None,
    token: str | None = None,
) -> dict:
    """
    Convert the checkpoint `src` (local folder or Hub repo id) into a Dual-Flow checkpoint folder `out` whose primary
    flow is exactly the source model (aux embedding = copy of the token embedding, couplings = 0).

    aux_top_k: aux-flow expert top-k (k_a); default k_p, which makes the aux flow reproduce the source exactly.
    aux_rounds: passes of the aux flow through the layers (`aux_num_rounds`); the extra rounds' gates start at 0, so
        parity holds for any value.
    aux_adapter_rank: rank of the aux adapters (`aux_adapter_rank`, 0 = none); their deltas start at 0 (parity holds).
    dtype: "auto" / None keeps each tensor's dtype; "float32", "bfloat16", "float16" (or the torch dtypes) cast.
    max_shard_size: output shard size limit ("5GB", "500MB" or bytes).
    verify: compare source and result logits / greedy generations (see `check_parity`); a mismatch raises and
        leaves `out` as it was.
    revision, token: for a Hub id, the branch, tag or commit to convert and the token to download it with (default:
        the `hf auth login` token or HF_TOKEN).
    Returns a summary dict (paths, shapes, tensor counts, and `parity` when verifying). Bad input raises
    DualFlowUserError before anything is written. The files are written into `out` in place (an existing empty folder,
    a symbolic link's target); any failure leaves `out` as it was, except that `overwrite` empties it first, once every
    input has been checked.
    """
    out = Path(out)
    if isinstance(dtype, torch.dtype):  # a torch dtype stands for its name
        dtype = next((name for name, value in DTYPES.items() if value == dtype), dtype)
    if dtype is not None and not (isinstance(dtype, str) and dtype in DTYPES):
        raise DualFlowUserError(f"dtype must be one of {', '.join(DTYPES)} (a name or the torch dtype), got {dtype!r}")
    torch_dtype = DTYPES.get(dtype or "auto")
    try:
        size = str(max_shard_size)
        max_shard_bytes = convert_file_size_to_int(int(size) if size.isdigit() else size)
    except ValueError:
        max_shard_bytes = 0
    if max_shard_bytes < 1:
        raise DualFlowUserError(
            f"--max-shard-size must be a positive size like 5GB, 500MB or 1000000, got {max_shard_size!r}"
        )
    check_output_folder(out, "convert", replace=overwrite)  # before a Hub source is downloaded

    src_dir, base_model = resolve_source(src, revision, token)
    if out.resolve().is_relative_to(src_dir.resolve()):
        raise DualFlowUserError(f"OUT {out} is inside the source folder {src}: choose an output folder outside it")
    if src_dir.resolve().is_relative_to(out.resolve()):
        raise DualFlowUserError(
            f"the source folder {src} is inside OUT {out}, which would replace it: choose another OUT"
        )
    source = SourceCheckpoint(src_dir)
    config = build_config(source, aux_top_k, torch_dtype, aux_rounds, aux_adapter_rank)
    if verify:
        _check_verifiable(source)
    targets = plan_targets(source, family_for(source.model_type), config, torch_dtype)
    # A custom tokenizer's code (tokenizer_config.json's auto_map; config.json's is replaced by the model's own)
    tokenizer_code = auto_map_code_files(src_dir, "tokenizer_config.json")

    with output_folder(out, "convert", replace=overwrite) as folder:
        out_dir = folder.path
        summary = write_checkpoint(targets, source, out_dir, max_shard_bytes, show_progress)
        config.save_pretrained(out_dir)
        code_dir = Path(modeling_dualflow.__file__).parent
        for name in modeling_dualflow.REMOTE_CODE_FILES:
            shutil.copy2(code_dir / name, out_dir / name)
        copied = _copy_passthrough_files(src_dir, out_dir, tokenizer_code)
        dequantize = source.quantization is not None
        parity = check_parity(src_dir, out_dir, torch_dtype, dequantize_source=dequantize) if verify else None
        if parity is not None and not parity["passed"]:
            raise DualFlowUserError(f"--verify failed, nothing written to {out}: {parity['summary']}")
        # The card is published with the model: it names the source by its Hub id where it has one, and local
        # folders by their names only.
        src_name, out_name = base_model or src_dir.resolve().name, out_dir.name
        write_model_card(
            out_dir,
            config,
            repo_id=out_name,
            base_model=base_model,
            license=license_of(src_dir),
            conversion_command=conversion_command(
                src_name, out_name, aux_top_k, dtype, max_shard_size, verify, aux_rounds, aux_adapter_rank, revision
            ),
            parity=_card_parity(parity),
        )
    return {
        **summary,
        "out": str(out),
        "source": str(src_dir),
        "model_type": source.model_type,
        "num_experts": config.num_experts,
        "top_k": config.num_experts_per_tok if config.num_experts else None,
        "aux_top_k": config.aux_num_experts_per_tok if config.num_experts else None,
        "copied_files": copied,
        "parity": parity,
    }
