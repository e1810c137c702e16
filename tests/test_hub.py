"""
Sharing: the folder that would be uploaded loads as remote code in a fresh process; card metadata; token errors; what
an upload carries, through a local stand-in for the Hub's HTTP API (no network).
"""

import base64
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
import torch
import yaml
from helpers import run_dualflow, signallable_process, tiny_model
from safetensors import safe_open
from transformers import ByT5Tokenizer

from dualflow.cli import main as cli_main
from dualflow.errors import DualFlowUserError
from dualflow.hub import check_upload_folder, prepare_upload_folder, published_files
from dualflow.lora import add_lora
from dualflow.model_card import retarget_card, write_adapter_card, write_model_card
from dualflow.output_folder import UNFINISHED_MARKER
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
    write_model_card(folder, model.config, repo_id="tiny-local", conversion_command="dualflow convert src tiny-local")
    card = retarget_card((folder / "README.md").read_text(), "someone/tiny-dualflow")
    assert 'from_pretrained("someone/tiny-dualflow", trust_remote_code=True)' in card and "\n# tiny-dualflow\n" in card
    assert "dualflow convert src tiny-local" in card  # the command that was run stays as it was
    assert "dual-flow" in yaml.safe_load(card.split("---\n")[1])["tags"]
    assert retarget_card(card, "someone/tiny-dualflow") == card
    assert retarget_card("# another card\n", "someone/tiny-dualflow") == "# another card\n"


def test_check_upload_folder_names_what_is_missing(upload_folder):
    _, folder = upload_folder
    assert check_upload_folder(folder) == "model"

    (folder / "cache_dualflow.py").rename(folder / "cache_dualflow.py.bak")
    with pytest.raises(DualFlowUserError, match="lacks the code files cache_dualflow.py"):
        check_upload_folder(folder)
    (folder / "cache_dualflow.py.bak").rename(folder / "cache_dualflow.py")

    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-100])  # an interrupted copy
    with pytest.raises(DualFlowUserError, match=f"{weights} is unreadable or truncated"):
        check_upload_folder(folder)
    weights.write_bytes(whole)

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
    from helpers import run_dualflow, tiny_model
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
    assert not (folder / "README.md").exists()  # a push never writes into the folder


def test_failed_push_changes_nothing_locally(upload_folder, capsys):
    # A card `dualflow convert` wrote for the local folder: a push would point it at the repo, a failed one must not.
    model, folder = upload_folder
    write_model_card(folder, model.config, repo_id="tiny-local")
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


# ---- uploads through a local stand-in for the Hub's HTTP API


class FakeHub(ThreadingHTTPServer):
    """
    Answers the requests of an upload (create repo, create branch, validate the card, pre-upload, commit) as the Hub
    does, has no repo to download, and records each request as (path, query, headers in lower case, body). The commit is answered once `release` is set.
    """

    def __init__(self):
        super().__init__(("127.0.0.1", 0), FakeHubHandler)
        self.requests = []
        self.commit_started = threading.Event()
        self.release = threading.Event()
        self.release.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def paths(self) -> list[str]:
        return [path for path, *_ in self.requests]

    def committed_files(self) -> dict[str, bytes]:
        """The files of the last commit (path -> content)."""
        body = next(body for path, _, _, body in reversed(self.requests) if "/commit/" in path)
        lines = [json.loads(line) for line in body.decode().splitlines()]
        return {
            line["value"]["path"]: base64.b64decode(line["value"]["content"]) for line in lines if line["key"] == "file"
        }


class FakeHubHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, payload: dict, status: int = 200):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        url = urlsplit(self.path)
        hub = self.server
        hub.requests.append((url.path, parse_qs(url.query), {k.lower(): v for k, v in self.headers.items()}, body))
        if url.path == "/api/repos/create":
            request = json.loads(body)
            self.answer({"url": f"{hub.url}/{request['organization']}/{request['name']}"})
        elif url.path == "/api/validate-yaml" or "/branch/" in url.path:
            self.answer({})
        elif "/preupload/" in url.path:
            files = json.loads(body)["files"]
            self.answer({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
        elif "/commit/" in url.path:
            hub.commit_started.set()
            hub.release.wait(120)
            repo = url.path.split("/")[3:5]
            self.answer(
                {
                    "commitUrl": f"{hub.url}/{'/'.join(repo)}/commit/{'0' * 40}",
                    "commitOid": "0" * 40,
                    "pullRequestUrl": f"{hub.url}/{'/'.join(repo)}/discussions/1",
                }
            )
        else:
            self.answer({"error": f"not found: {url.path}"}, 404)

    def do_GET(self):  # repo info: no repo is there to download
        url = urlsplit(self.path)
        self.server.requests.append(
            (url.path, parse_qs(url.query), {k.lower(): v for k, v in self.headers.items()}, b"")
        )
        data = json.dumps({"error": "Repository not found"}).encode()
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_hub(monkeypatch):
    from huggingface_hub import constants

    hub = FakeHub()
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    # What HF_ENDPOINT / HF_HUB_OFFLINE=0 set at import, for this process (conftest keeps the Hub offline otherwise).
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield hub
    hub.release.set()
    hub.shutdown()
    hub.server_close()


def folder_bytes(folder) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_push_publishes_no_local_path_and_leaves_the_folder_alone(upload_folder, fake_hub, tmp_path, capsys):
    model, folder = upload_folder
    # A card as `dualflow finetune` writes it: the usage snippets name the local output folder.
    write_model_card(folder, model.config, repo_id=str(folder))
    before = folder_bytes(folder)
    assert str(tmp_path) not in before["README.md"].decode()  # it names the folder by its name
    command = ["push", str(folder), "someone/tiny-dualflow", "--token", "hf_test", "--revision", "v1", "--create-pr"]
    assert cli_main(command) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip().endswith(f"to {fake_hub.url}/someone/tiny-dualflow/discussions/1")
    assert folder_bytes(folder) == before
    paths = fake_hub.paths()
    repo = "/api/models/someone/tiny-dualflow"
    order = [paths.index(path) for path in ("/api/repos/create", f"{repo}/branch/v1", f"{repo}/commit/v1")]
    assert order == sorted(order)  # the branch is created before the commit to it
    commit = next(request for request in fake_hub.requests if "/commit/" in request[0])
    assert commit[1] == {"create_pr": ["1"]}
    assert commit[2]["authorization"] == "Bearer hf_test"
    uploaded = fake_hub.committed_files()
    assert set(uploaded) == set(before)
    card = uploaded["README.md"].decode()
    assert 'from_pretrained("someone/tiny-dualflow", trust_remote_code=True)' in card
    assert not [name for name, data in uploaded.items() if str(tmp_path).encode() in data]
    assert {name: data for name, data in uploaded.items() if name != "README.md"} == {
        name: data for name, data in before.items() if name != "README.md"
    }


@pytest.fixture
def adapter_folder(tmp_path):
    base = tmp_path / "base"
    model = tiny_model(vocab_size=384)
    model.save_pretrained(base)
    adapter = tmp_path / "adapter"
    add_lora(model, r=2, lora_alpha=4).save_pretrained(adapter)
    # As `dualflow finetune --lora` writes it: the base named by its absolute path, so that it loads from anywhere here.
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": str(base)}))
    write_adapter_card(adapter, model.config, str(base), repo_id=str(adapter))
    return adapter


def test_adapter_with_a_local_base_needs_the_base_hub_id(adapter_folder, fake_hub, tmp_path, capsys):
    before = folder_bytes(adapter_folder)
    assert "`base`" in before["README.md"].decode() and str(tmp_path) not in before["README.md"].decode()
    assert cli_main(["push", str(adapter_folder), "someone/tiny-lora", "--token", "hf_test"]) == 2
    assert capsys.readouterr().err == (
        f"dualflow push: error: the adapter's base model is the local folder {tmp_path / 'base'}, which does not load "
        "from the Hub: upload the base too and pass its repo id with --base-model-id\n"
    )
    assert fake_hub.requests == []
    command = [
        "push",
        str(adapter_folder),
        "someone/tiny-lora",
        "--token",
        "hf_test",
        "--base-model-id",
        "someone/tiny",
    ]
    assert cli_main(command) == 0, capsys.readouterr().err
    uploaded = fake_hub.committed_files()
    assert json.loads(uploaded["adapter_config.json"])["base_model_name_or_path"] == "someone/tiny"
    card = uploaded["README.md"].decode()
    assert "base_model: someone/tiny" in card and "`someone/tiny`" in card
    assert 'AutoPeftModelForCausalLM.from_pretrained("someone/tiny-lora", trust_remote_code=True)' in card
    assert not [name for name, data in uploaded.items() if str(tmp_path).encode() in data]
    assert uploaded["adapter_model.safetensors"] == before["adapter_model.safetensors"]
    assert folder_bytes(adapter_folder) == before
    assert published_files(adapter_folder, "someone/tiny-lora", "adapter", "someone/tiny") == {
        name: uploaded[name] for name in ("README.md", "adapter_config.json")
    }


@pytest.mark.parametrize("base", ["base", "./base", "../base"])
def test_an_adapter_with_a_relative_local_base_is_not_taken_for_a_hub_id(adapter_folder, tmp_path, capsys, base):
    # "base" has the shape of a Hub id; PEFT saves whatever path the base was loaded from, relative ones included.
    config = json.loads((adapter_folder / "adapter_config.json").read_text())
    (adapter_folder / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": base}))
    assert cli_main(["push", str(adapter_folder), "someone/tiny-lora", "--dry-run"]) == 2
    assert "which does not load from the Hub: upload the base too" in capsys.readouterr().err


PUSH_COMMAND = [sys.executable, "-m", "dualflow.cli", "push"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_push_interrupted_during_the_upload_leaves_the_folder_as_it_was(upload_folder, tmp_path, signum):
    model, folder = upload_folder
    (folder / "README.md").unlink()  # a push adds the Dual-Flow card: to the upload only
    before = folder_bytes(folder)
    hub = FakeHub()
    hub.release.clear()  # the commit request waits: the upload is under way when the signal comes
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    env = hermetic_env(tmp_path, HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1")
    command = PUSH_COMMAND + [str(folder), "someone/tiny-dualflow", "--token", "hf_test"]
    process = signallable_process(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not hub.commit_started.wait(0.1):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=120)
    finally:
        hub.release.set()
        hub.shutdown()
        hub.server_close()
    expected = (130, "interrupted") if signum == signal.SIGINT else (143, "terminated (SIGTERM)")
    assert (process.returncode, stderr.strip().splitlines()[-1]) == (expected[0], f"dualflow push: {expected[1]}")
    assert "Traceback" not in stderr
    assert folder_bytes(folder) == before


def test_convert_revision_and_token_reach_the_hub(fake_hub, tmp_path):
    code, stderr = run_dualflow(
        "convert", "some-org/tiny-moe", tmp_path / "out", "--revision", "v2", "--token", "hf_private"
    )
    assert (code, stderr.count("\n")) == (2, 1), stderr
    assert "some-org/tiny-moe is neither a local folder nor a Hub repo you can access" in stderr
    repo_info = [headers for path, _, headers, _ in fake_hub.requests if path.startswith("/api/models/")]
    assert fake_hub.paths().count("/api/models/some-org/tiny-moe/revision/v2") == len(repo_info) > 0
    assert {headers["authorization"] for headers in repo_info} == {"Bearer hf_private"}
    assert os.listdir(tmp_path) == []


def dry_run(capsys, folder, repo_id, *options) -> tuple[dict[str, int], dict[str, str]]:
    """`dualflow push --dry-run`: the files that would go up with their sizes, and why each other entry stays local."""
    assert cli_main(["push", str(folder), repo_id, "--dry-run", *options]) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"dry run: nothing uploaded to {repo_id}"
    total = next(index for index, line in enumerate(lines) if line.endswith("files would be uploaded"))
    listed = {line.split()[1]: int(line.split()[0].replace(",", "")) for line in lines[1:total]}
    assert lines[total + 1 : total + 2] in ([], ["stays local:"])
    return listed, dict(line.strip().split(": ", 1) for line in lines[total + 2 :])


def test_push_dry_run_lists_what_a_model_repo_holds_and_nothing_private(upload_folder, capsys):
    _, folder = upload_folder
    # What a fine-tune leaves beside the model: Trainer checkpoints (pickles holding local paths), dotfiles, pickles.
    checkpoint = folder / "checkpoint-2"
    checkpoint.mkdir()
    for name in ("optimizer.pt", "rng_state.pth", "training_args.bin", "model.safetensors", "config.json"):
        (checkpoint / name).write_bytes(b"x" * 10)
    (folder / ".env").write_text("HF_TOKEN=secret\n")
    (folder / ".cache").mkdir()
    (folder / "training_args.bin").write_bytes(b"pickle")
    (folder / "notes.pkl").write_bytes(b"pickle")
    listed, local = dry_run(capsys, folder, "someone/tiny-dualflow")
    expected = {"README.md", "config.json", "model.safetensors", "tokenizer_config.json", *REMOTE_CODE_FILES}
    assert expected <= set(listed) and not {name for name in listed if name.endswith((".bin", ".pkl", ".pt"))}
    assert not {name for name in listed if name.startswith(".") or "/" in name}
    assert listed["model.safetensors"] == (folder / "model.safetensors").stat().st_size
    assert local == {
        ".cache/": "hidden folder",
        ".env": "hidden file",
        "checkpoint-2/": "Trainer checkpoint folder",
        "notes.pkl": "not a model-repository file",
        "training_args.bin": "not a model-repository file",
    }
    # A folder a run is still writing (or that was killed) is not published.
    (folder / UNFINISHED_MARKER).write_text("{}")
    assert cli_main(["push", str(folder), "someone/tiny-dualflow", "--dry-run"]) == 2
    assert "holds an unfinished run" in capsys.readouterr().err


def test_push_uploads_only_what_save_pretrained_wrote(upload_folder, fake_hub, capsys):
    # Python and safetensors files beside a saved model are not the model's: a secret, a training script, stale weights.
    _, folder = upload_folder
    saved = folder_bytes(folder)
    assert {"config.json", "model.safetensors", "README.md", "tokenizer_config.json", *REMOTE_CODE_FILES} <= set(saved)
    (folder / "_private_keys.py").write_text('HF_TOKEN = "hf_secret"\n')
    (folder / "train.py").write_text("from modeling_dualflow import DualFlowForCausalLM\n")
    (folder / "backup-2026.safetensors").write_bytes(b"not even safetensors")
    (folder / "model-old.safetensors").write_bytes(saved["model.safetensors"])
    (folder / "notes.md").write_text("run 3: lr 1e-4\n")
    listed, local = dry_run(capsys, folder, "someone/tiny-dualflow")
    assert set(listed) == set(saved)
    assert local == {
        "_private_keys.py": "Python file not named by auto_map",
        "backup-2026.safetensors": "not the model's weight file",
        "model-old.safetensors": "not the model's weight file",
        "notes.md": "not a model-repository file",
        "train.py": "Python file not named by auto_map",
    }
    assert cli_main(["push", str(folder), "someone/tiny-dualflow", "--token", "hf_test"]) == 0, capsys.readouterr().err
    uploaded = fake_hub.committed_files()
    assert set(uploaded) == set(saved) and not [name for name, data in uploaded.items() if b"hf_secret" in data]


def test_push_of_a_sharded_model_uploads_exactly_the_index_shards(tmp_path, fake_hub, capsys):
    folder = prepare_upload_folder(tiny_model(vocab_size=384), tmp_path / "upload", max_shard_size="100KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    saved = set(folder_bytes(folder))
    # A shard of an earlier save with other sizes, and a renamed whole checkpoint: both valid safetensors.
    (folder / "model-00001-of-00009.safetensors").write_bytes((folder / min(shards)).read_bytes())
    (folder / "model-old.safetensors").write_bytes((folder / min(shards)).read_bytes())
    listed, local = dry_run(capsys, folder, "someone/tiny-dualflow")
    assert {name for name in listed if name.endswith(".safetensors")} == shards and set(listed) == saved
    assert local == {
        "model-00001-of-00009.safetensors": "weights not named by the index",
        "model-old.safetensors": "weights not named by the index",
    }
    assert cli_main(["push", str(folder), "someone/tiny-dualflow", "--token", "hf_test"]) == 0, capsys.readouterr().err
    assert set(fake_hub.committed_files()) == saved
    # transformers would load model.safetensors and ignore the index: which set is stale is the user's call.
    (folder / "model-old.safetensors").rename(folder / "model.safetensors")
    assert cli_main(["push", str(folder), "someone/tiny-dualflow", "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        f"dualflow push: error: {folder} holds two sets of weights, model.safetensors and the shards its index "
        f"names ({', '.join(sorted(shards))}); transformers loads model.safetensors alone: move the stale set away "
        "(model.safetensors, or model.safetensors.index.json with its shards)\n"
    )


def test_push_accepts_an_index_of_model_safetensors_and_names_a_stale_one(upload_folder, fake_hub, capsys):
    # compressed-tensors writes an index beside model.safetensors that maps every tensor to it: consistent.
    _, folder = upload_folder
    with safe_open(folder / "model.safetensors", framework="pt") as weights:
        weight_map = dict.fromkeys(weights.keys(), "model.safetensors")
    index_path = folder / "model.safetensors.index.json"
    index_path.write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    saved = folder_bytes(folder)
    listed, local = dry_run(capsys, folder, "someone/tiny-dualflow")
    assert {"model.safetensors", "model.safetensors.index.json"} <= set(listed) and set(listed) == set(saved)
    assert local == {}
    assert cli_main(["push", str(folder), "someone/tiny-dualflow", "--token", "hf_test"]) == 0, capsys.readouterr().err
    assert fake_hub.committed_files()["model.safetensors"] == saved["model.safetensors"]
    # An index naming shards that are gone is the stale one; model.safetensors, the only weights, is what loads.
    weight_map[next(iter(weight_map))] = "model-00002-of-00002.safetensors"
    index_path.write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    assert cli_main(["push", str(folder), "someone/tiny-dualflow", "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        f"dualflow push: error: {index_path} is stale: it names model-00002-of-00002.safetensors, not in the "
        "folder, and transformers loads model.safetensors: remove the index\n"
    )


def test_push_of_an_adapter_uploads_only_adapter_files_card_and_tokenizer(adapter_folder, fake_hub, tmp_path, capsys):
    ByT5Tokenizer().save_pretrained(adapter_folder)
    saved = set(folder_bytes(adapter_folder))
    assert saved == {"README.md", "adapter_config.json", "adapter_model.safetensors", "added_tokens.json"} | {
        "tokenizer_config.json"
    }
    # The base model's files do not belong in an adapter repository, even when copied beside the adapter.
    for name in ("config.json", "model.safetensors", "modeling_dualflow.py"):
        (adapter_folder / name).write_bytes((tmp_path / "base" / name).read_bytes())
    (adapter_folder / "train.py").write_text("print('training')\n")
    options = ["--base-model-id", "someone/tiny"]
    listed, local = dry_run(capsys, adapter_folder, "someone/tiny-lora", *options)
    assert set(listed) == saved
    assert local == {
        "config.json": "not an adapter-repository file",
        "model.safetensors": "not the adapter's weight file",
        "modeling_dualflow.py": "Python file (an adapter repository holds no code)",
        "train.py": "Python file (an adapter repository holds no code)",
    }
    command = ["push", str(adapter_folder), "someone/tiny-lora", "--token", "hf_test", *options]
    assert cli_main(command) == 0, capsys.readouterr().err
    assert set(fake_hub.committed_files()) == saved
