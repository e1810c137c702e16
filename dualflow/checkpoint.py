"""Opening a Dual-Flow checkpoint (folder or Hub id): config and tokenizer, with a one-line error for anything else."""

import json
import os
from pathlib import Path

from .errors import DualFlowUserError


def is_hub_repo_id(text: str) -> bool:
    """
    Whether `text` is a Hub model id of the `org/name` form, by huggingface_hub's own rules (`validate_repo_id`). A bare
    `name`, valid on the Hub too, is taken as a local path: a missing folder then gets the clearer error.
    """
    if "/" not in text:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def check_model_path(model_path) -> None:
    """
    Fail at once, before torch or the Hub, for a path that cannot be a model: a local path (it exists, starts with
    `.`, `/` or `~`, its parent folder exists, or it is not of the Hub's `org/name` form) that is no model folder.
    """
    path, text = Path(model_path), str(model_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DualFlowUserError(f"{model_path} is not a model folder (no config.json)")
        return
    if path.exists():
        raise DualFlowUserError(f"{model_path} is a file, not a model folder")
    parent_exists = path.parent != Path(".") and path.parent.is_dir()
    if text.startswith((".", "/", "~")) or parent_exists or not is_hub_repo_id(text):
        raise DualFlowUserError(f"{model_path} does not exist (a local path; Hub ids look like org/name)")


def download_failure(src: str, error: Exception) -> str:
    """What failed and what to do, in one short line."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    if isinstance(error, GatedRepoError):
        return f"{src} is a gated Hub repo: accept its terms on huggingface.co, then `hf auth login`"
    if isinstance(error, RepositoryNotFoundError):
        return f"{src} is neither a local folder nor a Hub repo you can access (private? `hf auth login`)"
    if isinstance(error, LocalEntryNotFoundError) and constants.HF_HUB_OFFLINE:
        return f"{src} is not a local folder and Hub downloads are off (HF_HUB_OFFLINE): pass a local folder"
    if isinstance(error, LocalEntryNotFoundError):
        return f"{src} is not a local folder and the Hub is unreachable: check the network or pass a local folder"
    return f"{src} is not a local folder and its download failed ({type(error).__name__}): retry or pass a folder"


def load_dualflow_config(model_path):
    """The DualFlowConfig of a folder or Hub id; a DualFlowUserError when there is none or it is another model type."""
    from huggingface_hub.errors import StrictDataclassFieldValidationError
    from transformers import AutoConfig

    import modeling_dualflow  # noqa: F401  (registers the dualflow model type with the Auto classes)

    check_model_path(model_path)
    if not Path(model_path).is_dir():
        from huggingface_hub import snapshot_download

        # Asks the Hub once and falls back on the local cache, where AutoConfig offline retries for half a minute.
        try:
            snapshot_download(str(model_path), allow_patterns=["config.json"])
        except Exception as error:  # huggingface_hub's own messages run to several hundred characters
            raise DualFlowUserError(download_failure(str(model_path), error)) from None
    try:
        config = AutoConfig.from_pretrained(model_path)
    except StrictDataclassFieldValidationError as error:  # a field of the wrong type ("4" or null for an int)
        problem = " ".join(line.strip() for line in str(error).splitlines()[1:]) or str(error)
        raise DualFlowUserError(f"{model_path}/config.json: {problem}") from None
    except (OSError, ValueError) as error:
        raise DualFlowUserError(
            f"cannot load a model config from {model_path} ({str(error).splitlines()[0]})"
        ) from None
    if config.model_type != "dualflow":
        raise DualFlowUserError(
            f"{model_path} is a {config.model_type!r} model, not a Dual-Flow one: convert it first with `dualflow convert`"
        )
    return config


def load_dualflow_model(model_path, **kwargs):
    """
    `AutoModelForCausalLM.from_pretrained(model_path, **kwargs)`, the weights read in this thread; a DualFlowUserError
    when the weights do not load (a truncated or damaged file, a missing one).
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    # transformers reads the weights on worker threads. A Ctrl-C can stop this thread just after it took a lock of a
    # worker's result (`with` is not interrupt-safe): the worker then waits for it forever, and so does the process's
    # exit, which joins the workers. HF_DEACTIVATE_ASYNC_LOAD keeps the reading in this thread.
    previous = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    except (OSError, SafetensorError) as error:
        raise DualFlowUserError(
            f"the weights in {model_path} do not load: {str(error).strip().splitlines()[0]}"
        ) from None
    except RuntimeError as error:
        if "ignore_mismatched_sizes" not in str(error):
            raise
        raise DualFlowUserError(
            f"the weights in {model_path} do not match its config.json: tensor shapes differ from the config's sizes "
            "(vocab_size, hidden_size, ...; transformers' load report above names them)"
        ) from None
    finally:
        if previous is None:
            del os.environ["HF_DEACTIVATE_ASYNC_LOAD"]
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = previous


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# A model's tokenizer, chat template and generation defaults: `dualflow convert` copies them, `dualflow push` uploads them.
TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
    "generation_config.json",
)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def auto_map_code_files(folder: Path, config_file: str) -> list[str]:
    """
    The code files that the `auto_map` of `folder`'s `config_file` (config.json, or a tokenizer's
    tokenizer_config.json) names, as save_pretrained copies them (transformers' `custom_object_save`): the modules
    ("modeling_dualflow.DualFlowForCausalLM" -> modeling_dualflow.py) and the files they import relatively,
    recursively. None where the file or its `auto_map` is absent.
    """
    from transformers.dynamic_module_utils import get_relative_import_files

    path = folder / config_file
    if not path.is_file():
        return []
    try:
        auto_map = json.loads(path.read_text()).get("auto_map") or {}
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise DualFlowUserError(f"{path} is not a valid JSON object: {error}") from None
    # A tokenizer's entry is a [slow, fast] pair, either may be null; "org/repo--module.Class" is another repo's code
    references = [item for value in auto_map.values() for item in (value if isinstance(value, list) else [value])]
    modules = {reference.split(".")[0] for reference in references if reference and "--" not in reference}
    files = set()
    for module in modules:
        try:
            imported = get_relative_import_files(folder / f"{module}.py")
        except FileNotFoundError as error:
            raise DualFlowUserError(
                f"{folder} lacks {Path(error.filename).name}, which the code that {config_file}'s auto_map names needs"
            ) from None
        files |= {f"{module}.py", *(Path(path).name for path in imported)}
    return sorted(files)


def has_tokenizer(model_path) -> bool:
    """Whether a local model folder holds tokenizer files (a Hub id is assumed to)."""
    path = Path(model_path)
    return not path.is_dir() or any((path / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_path):
    """The model's tokenizer; a DualFlowUserError saying what to add when the folder has none or it does not load."""
    from transformers import AutoTokenizer

    if not has_tokenizer(model_path):
        raise DualFlowUserError(
            f"{model_path} has no tokenizer: add the source model's, e.g. "
            f"AutoTokenizer.from_pretrained(SOURCE).save_pretrained({str(model_path)!r}) "
            "(`dualflow convert` copies it when the source folder has one)"
        )
    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError) as error:
        raise DualFlowUserError(
            f"the tokenizer in {model_path} does not load: {str(error).strip().splitlines()[0]}"
        ) from None
