"""Sharing: the folder that would be uploaded loads as remote code in a fresh process; card metadata; token errors."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from helpers import tiny_model
from transformers import ByT5Tokenizer

from dualflow.cli import main as cli_main
from dualflow.errors import DualFlowUserError
from dualflow.hub import check_upload_folder, ensure_model_card, prepare_upload_folder
from dualflow.model_card import retarget_model_card, write_model_card
from modeling_dualflow import REMOTE_CODE_FILES


REMOTE_LOAD = textwrap.dedent(
    """
    import sys
    sys.modules["modeling_dualflow"] = None  # the package must not be importable: only the folder's code may be used
    sys.modules["dualflow"] = None
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    folder, probe_path, result_path = sys.argv[1:]
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert model.__class__.__module__.startswith("transformers_modules"), model.__class__.__module__
    base = AutoModel.from_pretrained(folder, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    probe = torch.load(probe_path)
    with torch.no_grad():
        out = model(probe)
        generated = model.generate(probe[:1], max_new_tokens=5, do_sample=False)
    torch.save({"logits": out.logits, "primary": out.primary_logits, "generated": generated,
                "base": type(base).__name__, "tokenizer": type(tokenizer).__name__}, result_path)
    """
)


def hermetic_env(tmp_path, **extra) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "HF_TOKEN"}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_MODULES_CACHE=str(tmp_path / "hf-modules"), HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


@pytest.fixture
def upload_folder(tmp_path):
    model = tiny_model(vocab_size=384)
    folder = prepare_upload_folder(
        model, tmp_path / "upload", ByT5Tokenizer(), repo_id="someone/tiny-dualflow", tags=["byte-level"]
    )
    return model, folder


def test_upload_folder_loads_as_remote_code_in_fresh_process(upload_folder, tmp_path):
    model, folder = upload_folder
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dualflow.DualFlowForCausalLM"
    assert all((folder / name).is_file() for name in REMOTE_CODE_FILES + ("model.safetensors", "README.md"))

    probe = torch.randint(0, 384, (2, 9))
    torch.save(probe, tmp_path / "probe.pt")
    script = tmp_path / "remote_load.py"
    script.write_text(REMOTE_LOAD)
    completed = subprocess.run(
        [sys.executable, str(script), str(folder), str(tmp_path / "probe.pt"), str(tmp_path / "result.pt")],
        cwd=tmp_path,
        env=hermetic_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = torch.load(tmp_path / "result.pt")
    with torch.no_grad():
        expected = model(probe)
        expected_generated = model.generate(probe[:1], max_new_tokens=5, do_sample=False)
    torch.testing.assert_close(result["logits"], expected.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(result["primary"], expected.primary_logits, rtol=0, atol=1e-5)
    assert torch.equal(result["generated"], expected_generated)
    assert (result["base"], result["tokenizer"]) == ("DualFlowModel", "ByT5Tokenizer")


def test_card_metadata_is_valid_yaml(upload_folder):
    _, folder = upload_folder
    card = (folder / "README.md").read_text()
    assert card.startswith("---\n")
    metadata = yaml.safe_load(card.split("---\n")[1])
    assert metadata["library_name"] == "transformers"
    assert metadata["pipeline_tag"] == "text-generation"
    assert {"dual-flow", "byte-level"} <= set(metadata["tags"])
    assert 'from_pretrained("someone/tiny-dualflow", trust_remote_code=True)' in card


def test_card_of_a_local_folder_is_retargeted_to_the_repo(upload_folder):
    model, folder = upload_folder
    write_model_card(
        folder, model.config, repo_id="./tiny-local", conversion_command="dualflow convert src ./tiny-local"
    )
    assert retarget_model_card(folder, "someone/tiny-dualflow")
    card = (folder / "README.md").read_text()
    assert 'from_pretrained("someone/tiny-dualflow", trust_remote_code=True)' in card and "\n# tiny-dualflow\n" in card
    assert "dualflow convert src ./tiny-local" in card  # the command that was run stays as it was
    assert "dual-flow" in yaml.safe_load(card.split("---\n")[1])["tags"]
    assert not retarget_model_card(folder, "someone/tiny-dualflow")


def test_check_upload_folder_names_what_is_missing(upload_folder):
    _, folder = upload_folder
    assert check_upload_folder(folder) == "model"

    (folder / "README.md").unlink()
    assert ensure_model_card(folder, "someone/tiny-dualflow") and (folder / "README.md").is_file()
    assert not ensure_model_card(folder, "someone/tiny-dualflow")

    (folder / "cache_dualflow.py").rename(folder / "cache_dualflow.py.bak")
    with pytest.raises(DualFlowUserError, match="lacks the code files cache_dualflow.py"):
        check_upload_folder(folder)
    (folder / "cache_dualflow.py.bak").rename(folder / "cache_dualflow.py")

    config = json.loads((folder / "config.json").read_text())
    del config["auto_map"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DualFlowUserError, match="auto_map lacks AutoConfig, AutoModelForCausalLM"):
        check_upload_folder(folder)


def test_push_cli_bad_folder_is_one_line_error(upload_folder, capsys):
    _, folder = upload_folder
    (folder / "model.safetensors").unlink()
    assert cli_main(["push", str(folder), "someone/tiny-dualflow"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == f"dualflow push: error: {folder} has no weights (model.safetensors or model.safetensors.index.json)"


PUSH_WITHOUT_TOKEN = textwrap.dedent(
    """
    import json, sys
    from helpers import tiny_model
    from dualflow.cli import main
    from dualflow.errors import DualFlowUserError
    from dualflow.hub import push_model

    status = main(["push", sys.argv[1], "someone/tiny-dualflow"])
    try:
        push_model(tiny_model(), "someone/tiny-dualflow", commit_message="upload", max_shard_size="1MB")
        push_error = None
    except DualFlowUserError as error:
        push_error = str(error)
    print(json.dumps({"status": status, "push_model_error": push_error}))
    """
)


def test_push_without_token_is_a_clear_error(upload_folder, tmp_path):
    _, folder = upload_folder
    (folder / "README.md").unlink()
    script = tmp_path / "push_without_token.py"
    script.write_text(PUSH_WITHOUT_TOKEN)
    tests_dir = os.path.dirname(__file__)
    completed = subprocess.run(
        [sys.executable, str(script), str(folder)],
        cwd=tmp_path,
        env=hermetic_env(tmp_path, PYTHONPATH=tests_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    message = "no Hugging Face token: run `hf auth login`, set HF_TOKEN or pass --token"
    assert completed.stderr.strip().splitlines()[-1] == f"dualflow push: error: {message}"
    assert json.loads(completed.stdout.strip().splitlines()[-1]) == {"status": 2, "push_model_error": message}
    assert not (folder / "README.md").exists()  # nothing is written before the token check passes


def test_failed_push_changes_nothing_locally(upload_folder, capsys):
    # A card `dualflow convert` wrote for the local folder: a push would point it at the repo, a failed one must not.
    model, folder = upload_folder
    write_model_card(folder, model.config, repo_id="./tiny-local")
    for card in ("retargeted", "missing"):
        before = {path.name: path.read_bytes() for path in folder.iterdir()}
        assert cli_main(["push", str(folder), "not a repo id", "--token", "hf_unused"]) == 2
        assert "'not a repo id' is not a Hub repo id" in capsys.readouterr().err
        # HF_HUB_OFFLINE=1 (conftest): the network is tried before the card is touched.
        assert cli_main(["push", str(folder), "someone/tiny-dualflow", "--token", "hf_unused"]) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith("dualflow push: error: upload to someone/tiny-dualflow failed") and "\n" not in error
        assert {path.name: path.read_bytes() for path in folder.iterdir()} == before, card
        (folder / "README.md").unlink(missing_ok=True)
