"""Model cards for Dual-Flow checkpoints, rendered from `model_cards/dualflow.md` with huggingface_hub."""

import json
import re
from importlib import resources
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData, metadata_load

from .checkpoint import is_hub_repo_id


def card_name(name: str) -> str:
    """How a card names a model: a Hub id as given, a local folder by its name only (cards are published)."""
    return name if is_hub_repo_id(name) else Path(name).expanduser().resolve().name


def render_model_card(
    config,
    repo_id: str = "path/to/this/folder",
    base_model: str | None = None,
    license: str | None = None,
    conversion_command: str | None = None,
    parity: dict | None = None,
    extra: str | None = None,
    tags: list[str] | None = None,
) -> ModelCard:
    """
    Card for a Dual-Flow checkpoint, which names `repo_id` by `card_name`. `parity`: dict with source_class,
    max_abs_diff_aux, max_abs_diff_primary, greedy_identical (as `dualflow convert --verify` reports it). `extra`:
    markdown appended to the body. `tags`: added to the card's own (dual-flow, custom_code, moe).
    """
    repo_id = card_name(repo_id)
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["dual-flow", "custom_code"] + (["moe"] if config.num_experts else []) + list(tags or []),
        base_model=base_model,
        license=license,
    )
    template = resources.files("dualflow.model_cards").joinpath("dualflow.md").read_text()
    return ModelCard.from_template(
        card_data,
        template_str=template,
        model_name=repo_id.rstrip("/").split("/")[-1],
        repo_id=repo_id,
        base_model=base_model,
        architecture=(config.architectures or ["DualFlowForCausalLM"])[0],
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_experts=config.num_experts,
        primary_top_k=config.num_experts_per_tok,
        aux_top_k=config.aux_num_experts_per_tok,
        use_aux_flow=config.use_aux_flow,
        conversion_command=conversion_command,
        parity=parity,
        extra=extra,
    )


def retarget_card(card: str, repo_id: str) -> str:
    """
    The Dual-Flow card `card` (a README.md's text) with its title and usage snippets pointed at `repo_id` (cards
    written by `dualflow convert` / `finetune` name the local folder); any other card unchanged.
    """
    if "dual-flow" not in (ModelCard(card).data.to_dict().get("tags") or []):
        return card
    match = re.search(r'from_pretrained\("([^"]+)", trust_remote_code=True\)', card)
    if match is None or match[1] == repo_id:
        return card
    old_name, new_name = (name.rstrip("/").split("/")[-1] for name in (match[1], repo_id))
    return card.replace(f'"{match[1]}"', f'"{repo_id}"').replace(f"\n# {old_name}\n", f"\n# {new_name}\n", 1)


def license_of(folder) -> str | None:
    """The `license` in the YAML metadata of `folder/README.md`, if the folder has a card."""
    card = Path(folder) / "README.md"
    return (metadata_load(card) or {}).get("license") if card.is_file() else None


def write_adapter_card(out_dir, config, base_model: str, repo_id: str, extra: str | None = None) -> Path:
    """
    Card of a `dualflow finetune --lora` adapter folder (replacing PEFT's placeholder README.md): the base model, how
    to load and merge it, and `extra` (how it was trained). Reads r and alpha from the folder's adapter_config.json.
    Names `base_model` and `repo_id` by `card_name`.
    """
    from .lora import projection_rank  # PEFT and torch: only for a LoRA run's card

    out_dir = Path(out_dir)
    lora_r, lora_alpha = projection_rank(json.loads((out_dir / "adapter_config.json").read_text()))
    card_data = ModelCardData(
        library_name="peft",
        pipeline_tag="text-generation",
        tags=["dual-flow", "custom_code", "lora"] + (["moe"] if config.num_experts else []),
        # Hub metadata names a Hub repo; a local base folder is named in the text only.
        base_model=base_model if is_hub_repo_id(base_model) else None,
    )
    template = resources.files("dualflow.model_cards").joinpath("dualflow_adapter.md").read_text()
    card = ModelCard.from_template(
        card_data,
        template_str=template,
        model_name=card_name(repo_id).split("/")[-1],
        repo_id=card_name(repo_id),
        base_model=card_name(base_model),
        lora_r=lora_r,
        lora_alpha=lora_alpha,
        num_experts=config.num_experts,
        extra=extra,
    )
    card.save(out_dir / "README.md")
    return out_dir / "README.md"


def write_model_card(out_dir, config, **kwargs) -> Path:
    """Render the card (see `render_model_card`) into `out_dir/README.md`."""
    path = Path(out_dir) / "README.md"
    render_model_card(config, **kwargs).save(path)
    return path
