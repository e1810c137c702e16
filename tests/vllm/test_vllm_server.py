"""vLLM's OpenAI-compatible server on a Dual-Flow folder (no model flags) with the `openai` client: completions and chat give transformers' greedy
tokens, streaming gives the same text, and prompt logprobs (refused by vLLM with the aux flow on) and per-request aux-flow
settings (engine settings) get a clean 400."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
from vllm_reference import hf_greedy, load_reference, random_prompts, word_tokenizer


MAX_NEW = 8
STARTUP_SECONDS = 600  # three processes that each import vLLM, on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_session(process: subprocess.Popen, seconds: float) -> None:
    """SIGTERM to a process started with `start_new_session=True`; if it has not ended after `seconds` (a server still
    starting, an engine stuck in its shutdown), SIGKILL to its whole session, its engine processes included."""
    process.terminate()
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    # The command docs/serving.md gives (vLLM's server module), with the middleware that refuses per-request
    # aux-flow settings.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
    command += ["--middleware", "dualflow.serving.middleware.refuse_aux_fields", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--dtype", "float32", "--max-model-len", "256", "--block-size", "32"]
    with open(log, "w") as out:
        # the server's engine in a process of its own, as users run it (the tests' own engines run in-process)
        env = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve did not start in {STARTUP_SECONDS} s") from None
                time.sleep(1)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused"), str(checkpoint)
    finally:
        stop_session(process, 60)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference(checkpoint)


GREEDY = dict(max_tokens=MAX_NEW, temperature=0.0, extra_body={"return_token_ids": True, "ignore_eos": True})


def test_completions_match_transformers(server, reference):
    client, model = server
    tokenizer = word_tokenizer()
    for prompt in random_prompts([4, 19]):
        text = tokenizer.decode(prompt)
        assert tokenizer(text).input_ids == prompt
        choice = client.completions.create(model=model, prompt=text, **GREEDY).choices[0]
        assert choice.token_ids == hf_greedy(reference, prompt, MAX_NEW)[0]


def test_streaming_gives_the_same_completion(server):
    client, model = server
    text = word_tokenizer().decode(random_prompts([11], seed=5)[0])
    whole = client.completions.create(model=model, prompt=text, **GREEDY).choices[0]
    stream = client.completions.create(model=model, prompt=text, stream=True, **GREEDY)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert len(chunks) > 1
    assert [t for chunk in chunks for t in (chunk.token_ids or [])] == whole.token_ids
    assert "".join(chunk.text for chunk in chunks) == whole.text


def test_chat_completions_match_transformers(server, reference):
    client, model = server
    messages = [{"role": "user", "content": "w7 w8 w9 w10"}]
    tokenizer = word_tokenizer()
    prompt = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)).input_ids
    choice = client.chat.completions.create(model=model, messages=messages, **GREEDY).choices[0]
    assert choice.token_ids == hf_greedy(reference, prompt, MAX_NEW)[0]


def test_prompt_logprobs_are_refused_with_the_aux_flow_on(server):
    client, model = server
    with pytest.raises(openai.BadRequestError, match="prompt logprobs"):
        client.completions.create(model=model, prompt="w7 w8 w9", max_tokens=1, extra_body={"prompt_logprobs": 1})


@pytest.mark.parametrize("field", [{"use_aux_flow": False}, {"aux_num_experts_per_tok": 8}])
def test_per_request_aux_settings_are_refused(server, field):
    client, model = server
    with pytest.raises(openai.BadRequestError, match="per-request aux-flow settings are not supported"):
        client.completions.create(model=model, prompt="w7 w8 w9", max_tokens=1, extra_body=field)
    messages = [{"role": "user", "content": "w7"}]
    with pytest.raises(openai.BadRequestError, match=next(iter(field))):
        client.chat.completions.create(model=model, messages=messages, max_tokens=1, extra_body=field)
