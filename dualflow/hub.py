"""
Share Dual-Flow checkpoints on the Hugging Face Hub (`dualflow push`).

A shared model folder must load anywhere with `trust_remote_code=True`: config.json with `auto_map`, the three code
files, the weights and a model card. `push_model` (the arguments of transformers' `push_to_hub`) writes all of that,
the Dual-Flow card from `model_cards/` included, and uploads it in one commit; `dualflow push` checks and uploads a
folder that is already written, and changes nothing in it unless the upload goes through. torch, transformers and
huggingface_hub are imported only when needed, so `dualflow push --help` is instant.
"""

import argparse
import json
import tempfile
from pathlib import Path

from .errors import DualFlowUserError


AUTO_CLASSES = ("AutoConfig", "AutoModelForCausalLM")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def check_upload_folder(folder) -> str:
    """Raise a DualFlowUserError naming the first thing a shared folder lacks; return "model" or "adapter"."""
    from modeling_dualflow import REMOTE_CODE_FILES

    folder = Path(folder)
    if not folder.is_dir():
        raise DualFlowUserError(f"{folder} is not a folder")
    if (folder / "adapter_config.json").is_file():  # a `dualflow finetune --lora` output
        missing = [name for name in ADAPTER_FILES if not (folder / name).is_file()]
        if missing:
            raise DualFlowUserError(
                f"adapter folder {folder} lacks {', '.join(missing)}: save it with PeftModel.save_pretrained"
            )
        return "adapter"
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise DualFlowUserError(f"{folder} has no config.json: save the model there with save_pretrained first")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DualFlowUserError(f"{config_path} is not valid JSON: {error}") from None
    if config.get("model_type") != "dualflow":
        raise DualFlowUserError(f"{config_path} is a {config.get('model_type')!r} model, not a Dual-Flow one")
    missing = [name for name in AUTO_CLASSES if name not in (config.get("auto_map") or {})]
    if missing:
        raise DualFlowUserError(
            f"{config_path} auto_map lacks {', '.join(missing)}: save the model with the dualflow package imported"
        )
    missing = [name for name in REMOTE_CODE_FILES if not (folder / name).is_file()]
    if missing:
        raise DualFlowUserError(
            f"{folder} lacks the code files {', '.join(missing)}: save the model with save_pretrained"
        )
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise DualFlowUserError(f"{folder} has no weights ({' or '.join(WEIGHT_FILES)})")
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise DualFlowUserError(f"{folder} lacks weight shards listed in its index: {', '.join(missing)}")
    return "model"


def ensure_model_card(folder, repo_id: str) -> bool:
    """Write the Dual-Flow model card into a model folder that has no README.md; True when one was written."""
    from modeling_dualflow import DualFlowConfig

    from .model_card import write_model_card

    if (Path(folder) / "README.md").is_file():
        return False
    write_model_card(folder, DualFlowConfig.from_pretrained(folder), repo_id=repo_id)
    return True


def hub_token(token: str | None = None) -> str:
    """The token to upload with; checked before any network call."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise DualFlowUserError("no Hugging Face token: run `hf auth login`, set HF_TOKEN or pass --token")
    return token


def check_repo_id(repo_id: str) -> None:
    """A one-line error for a repo id the Hub would refuse, before any file is written or the network is tried."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise DualFlowUserError(f"{repo_id!r} is not a Hub repo id (like your-name/model-dualflow): {error}") from None


def push_folder(
    folder,
    repo_id: str,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    **upload_kwargs,
) -> str:
    """
    Check `folder`, add the card if missing, create `repo_id` (if needed) and upload the folder; returns its URL.
    `upload_kwargs` (commit_description, revision, create_pr) go to `HfApi.upload_folder`.
    """
    from huggingface_hub import HfApi

    from .model_card import retarget_model_card

    kind = check_upload_folder(folder)
    check_repo_id(repo_id)
    token = hub_token(token)
    api = HfApi(token=token)
    try:  # the first network call: offline, no network or a refused token fail here, before the folder is touched
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    except Exception as error:  # HTTP status errors, offline mode, and transport errors (refused, DNS, timeout)
        raise _upload_failed(repo_id, error) from None
    card_path = Path(folder) / "README.md"
    card_before = card_path.read_bytes() if card_path.is_file() else None
    card_note = None
    if kind == "model" and ensure_model_card(folder, repo_id):
        card_note = f"wrote a model card to {card_path}"
    elif kind == "model" and retarget_model_card(folder, repo_id):
        card_note = f"pointed the model card's usage snippets at {repo_id}"
    try:
        api.upload_folder(
            repo_id=repo_url.repo_id,
            folder_path=folder,
            commit_message=commit_message or f"Upload Dual-Flow {kind}",
            **upload_kwargs,
        )
    except Exception as error:
        # A failed push changes nothing locally: the card goes back to what it was.
        if card_before is None:
            card_path.unlink(missing_ok=True)
        else:
            card_path.write_bytes(card_before)
        raise _upload_failed(repo_id, error) from None
    if card_note:
        print(card_note)
    return str(repo_url)


def _upload_failed(repo_id: str, error: Exception) -> DualFlowUserError:
    return DualFlowUserError(f"upload to {repo_id} failed: {str(error).splitlines()[0]}")


def prepare_upload_folder(model, folder, tokenizer=None, max_shard_size="50GB", **card_kwargs) -> Path:
    """
    Write exactly what should be shared into `folder`: config with auto_map, code files and weights (save_pretrained
    of a DualFlowForCausalLM), the tokenizer if given, and the Dual-Flow card (`card_kwargs` go to
    `dualflow.model_card.render_model_card`, e.g. repo_id, base_model, license, tags).
    """
    from .model_card import write_model_card

    folder = Path(folder)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    write_model_card(folder, model.config, **card_kwargs)
    check_upload_folder(folder)
    return folder


def push_model(
    model,
    repo_id: str,
    tokenizer=None,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size="50GB",
    **card_kwargs,
) -> str:
    """
    `PreTrainedModel.push_to_hub` (same arguments) with the Dual-Flow card: prepare the folder in a temporary
    directory and upload it in one commit. `card_kwargs` go to `render_model_card` (base_model, license, tags, ...).
    """
    check_repo_id(repo_id)
    token = hub_token(token)
    with tempfile.TemporaryDirectory(prefix="dualflow-push-") as folder:
        prepare_upload_folder(model, folder, tokenizer, max_shard_size=max_shard_size, repo_id=repo_id, **card_kwargs)
        return push_folder(
            folder,
            repo_id,
            private=private,
            token=token,
            commit_message=commit_message,
            commit_description=commit_description,
            revision=revision,
            create_pr=create_pr,
        )


def build_parser(prog: str = "dualflow push") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Check the folder (config auto_map, code files, weights), add a model card if missing, upload.",
    )
    parser.add_argument("folder", help="folder written by save_pretrained / dualflow convert / dualflow finetune")
    parser.add_argument("repo_id", help="Hub repository, e.g. your-name/model-dualflow")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--token", help="Hub token (default: HF_TOKEN or the `hf auth login` token)")
    parser.add_argument("--commit-message", help="commit message (default: 'Upload Dual-Flow model')")
    return parser


def run(args) -> int:
    url = push_folder(
        args.folder, args.repo_id, private=args.private, token=args.token, commit_message=args.commit_message
    )
    print(f"uploaded {args.folder} to {url}")
    return 0
