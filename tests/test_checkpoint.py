"""dualflow.checkpoint: which model paths are Hub ids."""

from dualflow.checkpoint import is_hub_repo_id


def test_hub_repo_ids_follow_huggingface_hub():
    """One rule (huggingface_hub's `validate_repo_id`) for `dualflow convert`'s source and the tools' model paths."""
    assert is_hub_repo_id("some-org/tiny.model_v2")
    for text in ("tiny", "a/b/c", "org/name.git", "org/na..me", "org--x/name", "-org/name", "org/name!"):
        assert not is_hub_repo_id(text), text
