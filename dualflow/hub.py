"""
Share Dual-Flow checkpoints on the Hugging Face Hub (`dualflow push`).

A shared model folder must load anywhere with `trust_remote_code=True`: config.json with `auto_map`, the code files,
the weights and a model card. `push_model` (the arguments of transformers' `push_to_hub`) writes all of that,
the Dual-Flow card from `model_cards/` included, and uploads it in one commit; `dualflow push` checks and uploads a
folder that is already written, and never changes it: the card it adds or points at the repo, and an adapter's base
named by its Hub id, exist only in the upload, which names no local path. torch, transformers and huggingface_hub are
imported only when needed, so `dualflow push --help` is instant.
"""

import argparse
import json
import tempfile
from fnmatch import fnmatchcase
from pathlib import Path

from .checkpoint import TOKENIZER_PATTERNS, WEIGHT_FILES, auto_map_code_files, is_hub_repo_id
from .errors import DualFlowUserError


AUTO_CLASSES = ("AutoConfig", "AutoModelForCausalLM")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# What any repository shares beside the model or adapter files: the card, a license, the tokenizer, chat template and
# generation defaults.
SHARED_PATTERNS = ("README.md", "LICENSE*", *TOKENIZER_PATTERNS)


def check_upload_folder(folder) -> str:
    """Raise a DualFlowUserError naming the first thing a shared folder lacks; return "model" or "adapter"."""
    from modeling_dualflow import REMOTE_CODE_FILES

    from .output_folder import UNFINISHED_MARKER

    folder = Path(folder)
    if not folder.is_dir():
        raise DualFlowUserError(f"{folder} is not a folder")
    if (folder / UNFINISHED_MARKER).is_file():
        raise DualFlowUserError(
            f"{folder} holds an unfinished run ({UNFINISHED_MARKER}): push a finished model, or one of its "
            f"checkpoints on purpose (dualflow push {folder / 'checkpoint-N'} REPO_ID)"
        )
    if (folder / "adapter_config.json").is_file():  # a `dualflow finetune --lora` output
        missing = [name for name in ADAPTER_FILES if not (folder / name).is_file()]
        if missing:
            raise DualFlowUserError(
                f"adapter folder {folder} lacks {', '.join(missing)}: save it with PeftModel.save_pretrained"
            )
        _check_weights(folder, ["adapter_model.safetensors"])
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
    weights = model_weight_files(folder)
    missing = [name for name in weights if not (folder / name).is_file()]
    if missing:
        raise DualFlowUserError(f"{folder} lacks weight shards listed in its index: {', '.join(missing)}")
    _check_weights(folder, [name for name in weights if name.endswith(".safetensors")])
    return "model"


def model_weight_files(folder: Path) -> list[str]:
    """
    The weight files the model loads from: model.safetensors (with an index that maps every tensor to it, as
    compressed-tensors writes), or the index and exactly the shards it lists.
    """
    index_path = folder / "model.safetensors.index.json"
    single = (folder / "model.safetensors").is_file()
    if not index_path.is_file():
        if single:
            return ["model.safetensors"]
        raise DualFlowUserError(f"{folder} has no weights ({' or '.join(WEIGHT_FILES)})")
    try:
        shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as error:
        raise DualFlowUserError(f"{index_path} is not a valid safetensors index: {error!r}") from None
    if not single or shards == ["model.safetensors"]:
        return [index_path.name, *shards]
    # transformers loads model.safetensors whenever it is present and ignores the index
    absent = [name for name in shards if not (folder / name).is_file()]
    if absent:
        raise DualFlowUserError(
            f"{index_path} is stale: it names {', '.join(absent)}, not in the folder, and transformers loads "
            "model.safetensors: remove the index"
        )
    others = [name for name in shards if name != "model.safetensors"]
    raise DualFlowUserError(
        f"{folder} holds two sets of weights, model.safetensors and the shards its index names "
        f"({', '.join(others)}); transformers loads model.safetensors alone: move the stale set away "
        "(model.safetensors, or model.safetensors.index.json with its shards)"
    )


def remote_code_files(folder: Path) -> list[str]:
    """The code files the model and its tokenizer load with: those config.json's and tokenizer_config.json's auto_map name."""
    return sorted({*auto_map_code_files(folder, "config.json"), *auto_map_code_files(folder, "tokenizer_config.json")})


def split_folder(folder, kind: str) -> tuple[list[str], dict[str, str]]:
    """
    The folder's files a push uploads, and why each other entry stays local. Uploaded is exactly what save_pretrained,
    the tokenizer, the card and PEFT write (the weights the model loads, the code files `auto_map` needs, tokenizer
    files, card, license), never a stale or private file that happens to sit beside the model.
    """
    folder = Path(folder)
    if kind == "model":
        weights = model_weight_files(folder)
        own = {"config.json", *weights, *remote_code_files(folder)}
        sharded = weights != ["model.safetensors"]
        other_weights = "weights not named by the index" if sharded else "not the model's weight file"
        other_code, other_file = "Python file not named by auto_map", "not a model-repository file"
    else:
        own = set(ADAPTER_FILES)
        other_weights = "not the adapter's weight file"
        other_code, other_file = "Python file (an adapter repository holds no code)", "not an adapter-repository file"
    published, local = [], {}
    for path in sorted(folder.iterdir()):
        name = path.name
        if name.startswith("."):
            local[name + "/" * path.is_dir()] = "hidden folder" if path.is_dir() else "hidden file"
        elif path.is_dir():
            checkpoint = name.removeprefix("checkpoint-").isdigit()
            local[name + "/"] = "Trainer checkpoint folder" if checkpoint else "subfolder"
        elif not path.is_file():
            local[name] = "not a file"
        elif name in own:
            published.append(name)
        elif name.endswith(".py"):
            local[name] = other_code
        elif name.endswith(".safetensors"):
            local[name] = other_weights
        elif any(fnmatchcase(name, pattern) for pattern in SHARED_PATTERNS):
            published.append(name)
        else:
            local[name] = other_file
    return published, local


def _check_weights(folder: Path, names):
    """Each safetensors file's header must be valid and its size what the header says (a truncated copy is not)."""
    from safetensors import SafetensorError, safe_open

    for name in names:
        try:
            with safe_open(folder / name, framework="pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise DualFlowUserError(f"{folder / name} is unreadable or truncated ({error}): save it again") from None


def published_files(folder, repo_id: str, kind: str, base_model_id: str | None = None) -> dict[str, bytes]:
    """
    What the upload carries in place of the folder's own files (the folder itself is not changed): the Dual-Flow card
    pointed at `repo_id` (rendered if the folder has none); for an adapter, its config and card naming the base
    model by its Hub id, `base_model_id`, which is required when the adapter names a local folder.
    """
    from huggingface_hub import ModelCard

    from .model_card import card_name, render_model_card, retarget_card

    folder = Path(folder)
    card_path = folder / "README.md"
    if card_path.is_file():
        card = retarget_card(card_path.read_text(encoding="utf-8"), repo_id)
    elif kind == "model":
        from modeling_dualflow import DualFlowConfig

        card = str(render_model_card(DualFlowConfig.from_pretrained(folder), repo_id=repo_id))
    else:
        card = None
    published = {"README.md": card.encode()} if card is not None else {}
    if kind == "model":
        if base_model_id is not None:
            raise DualFlowUserError("--base-model-id is for adapter folders; this folder holds a whole model")
        return published
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    base = adapter_config.get("base_model_name_or_path") or ""
    if base_model_id is None:
        local = base.startswith((".", "/", "~")) or any(
            (where / base).expanduser().exists() for where in (Path.cwd(), folder, folder.parent)
        )
        if local or not is_hub_repo_id(base):
            raise DualFlowUserError(
                f"the adapter's base model is the local folder {base}, which does not load from the Hub: upload the "
                "base too and pass its repo id with --base-model-id"
            )
        return published
    check_repo_id(base_model_id)
    adapter_config["base_model_name_or_path"] = base_model_id
    published["adapter_config.json"] = (json.dumps(adapter_config, indent=2, sort_keys=True) + "\n").encode()
    if card is not None:  # cards name a local base by its folder's name (older ones by its path)
        card = card.replace(f"`{card_name(base)}`", f"`{base_model_id}`") if base else card
        card = ModelCard(card.replace(base, base_model_id) if base else card)
        card.data.base_model = base_model_id
        published["README.md"] = str(card).encode()
    return published


def hub_token(token: str | None = None) -> str:
    """The token to upload with; checked before any network call."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise DualFlowUserError("no Hugging Face token: run `hf auth login`, set HF_TOKEN or pass --token")
    return token


def check_repo_id(repo_id: str) -> None:
    """A one-line error for a repo id the Hub would refuse, before the network is tried."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise DualFlowUserError(f"{repo_id!r} is not a Hub repo id (like your-name/model-dualflow): {error}") from None


def upload_contents(
    folder, repo_id: str, base_model_id: str | None = None
) -> tuple[str, dict[str, Path | bytes], dict[str, str]]:
    """
    The folder's kind ("model" or "adapter"), what `push_folder` uploads by path in the repo (the files `split_folder`
    picks, with `published_files` in place of their own), and why each other entry of the folder stays local. Checks
    the folder and the repo id first.
    """
    folder = Path(folder)
    kind = check_upload_folder(folder)
    check_repo_id(repo_id)
    published = published_files(folder, repo_id, kind, base_model_id)
    names, local = split_folder(folder, kind)
    contents = {name: folder / name for name in names} | published
    return kind, dict(sorted(contents.items())), local


def dry_run_listing(contents: dict[str, Path | bytes], local: dict[str, str]) -> str:
    """`dualflow push --dry-run`'s report: each file that would go up with its size, and what stays local and why."""
    sizes = {
        name: len(content) if isinstance(content, bytes) else content.stat().st_size
        for name, content in contents.items()
    }
    lines = [f"{size:>14,}  {name}" for name, size in sizes.items()]
    lines.append(f"{sum(sizes.values()):>14,}  bytes in {len(sizes)} files would be uploaded")
    if local:
        lines.append("stays local:")
        lines += [f"  {name}: {reason}" for name, reason in local.items()]
    return "\n".join(lines)


def push_folder(
    folder,
    repo_id: str,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    commit_description: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    base_model_id: str | None = None,
) -> str:
    """
    Check `folder`, create `repo_id` (if needed) and upload the folder in one commit, with the files
    `published_files` gives in place of its own; returns the repo's URL (the pull request's with `create_pr`).
    `revision`: the branch to commit to (created if needed; with `create_pr`, the branch the pull request targets).
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    kind, contents, _ = upload_contents(folder, repo_id, base_model_id)
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=content) for name, content in contents.items()]
    api = HfApi(token=hub_token(token))
    try:  # offline, no network or a refused token fail at the first call
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision is not None and not revision.startswith("refs/pr/"):
            api.create_branch(repo_url.repo_id, branch=revision, exist_ok=True)
        commit = api.create_commit(
            repo_url.repo_id,
            operations,
            commit_message=commit_message or f"Upload Dual-Flow {kind}",
            commit_description=commit_description,
            revision=revision,
            create_pr=create_pr,
        )
    except Exception as error:  # HTTP status errors, offline mode, and transport errors (refused, DNS, timeout)
        raise _upload_failed(repo_id, error) from None
    return commit.pr_url if create_pr else str(repo_url)


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
        description=(
            "Check the folder (config auto_map, code files, weights) and upload it with the Dual-Flow model card; "
            "the folder itself is not changed."
        ),
    )
    parser.add_argument("folder", help="folder written by save_pretrained / dualflow convert / dualflow finetune")
    parser.add_argument("repo_id", help="Hub repository, e.g. your-name/model-dualflow")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--token", help="Hub token (default: HF_TOKEN or the `hf auth login` token)")
    parser.add_argument("--commit-message", help="commit message (default: 'Upload Dual-Flow model')")
    parser.add_argument("--revision", help="branch to commit to, created if needed (default: main)")
    parser.add_argument(
        "--create-pr", action="store_true", help="open a pull request (against --revision, or main) instead"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="list the files and sizes that would be uploaded, and what stays local; upload nothing",
    )
    parser.add_argument(
        "--base-model-id",
        help="for a LoRA adapter folder: the Hub repo id of its base model, published in place of a local folder",
    )
    return parser


def run(args) -> int:
    if args.dry_run:
        print(f"dry run: nothing uploaded to {args.repo_id}")
        _, contents, local = upload_contents(args.folder, args.repo_id, args.base_model_id)
        print(dry_run_listing(contents, local))
        return 0
    url = push_folder(
        args.folder,
        args.repo_id,
        private=args.private,
        token=args.token,
        commit_message=args.commit_message,
        revision=args.revision,
        create_pr=args.create_pr,
        base_model_id=args.base_model_id,
    )
    print(f"uploaded {args.folder} to {url}")
    return 0
