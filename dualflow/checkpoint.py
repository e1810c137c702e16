"""Loading a Dual-Flow checkpoint's config with a one-line error for anything else."""

from pathlib import Path

from transformers import AutoConfig

from .errors import DualFlowUserError


def load_dualflow_config(model_path):
    """The DualFlowConfig of a folder or Hub id; a DualFlowUserError when there is none or it is another model type."""
    path = Path(model_path)
    if path.is_dir() and not (path / "config.json").is_file():
        raise DualFlowUserError(f"{model_path} is not a model folder (no config.json)")
    if not path.exists() and (path.is_absolute() or str(model_path).startswith(".")):
        raise DualFlowUserError(f"{model_path} does not exist")
    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as error:
        raise DualFlowUserError(
            f"cannot load a model config from {model_path} ({str(error).splitlines()[0]})"
        ) from None
    if config.model_type != "dualflow":
        raise DualFlowUserError(
            f"{model_path} is a {config.model_type!r} model, not a Dual-Flow one: convert it first with `dualflow convert`"
        )
    return config
