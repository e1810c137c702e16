"""Prefill on the base model, decode with Dual-Flow (docs/serving.md): vLLM's native Qwen3-MoE engine (or the Dual-Flow
checkpoint, aux flow on or off) writes the prompts' KV through the ExampleConnector, a Dual-Flow engine reads it and
decodes the Dual-Flow engine's tokens. The aux attention layers (KV-sharing, no pages of their own) are neither saved
nor loaded; KV of another model is refused. The same over the NixlConnector: a base-model engine in a process of its
own (nixl_producer.py) as producer, a Dual-Flow engine reading the KV from its memory."""

import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from nixl_producer import PARAMS_LINE
from safetensors.torch import load_file, save_file
from test_vllm_parity import record_attention_calls, recorded_attention_calls
from test_vllm_server import free_port, stop_session
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from vllm.distributed.kv_transfer import get_kv_transfer_group
from vllm_reference import (
    ENGINE_ARGS,
    SOURCE,
    assert_matches_transformers,
    hf_greedy,
    load_reference,
    random_prompts,
    running_engine,
    served_greedy,
)


# Not multiples of the block size (32): the connector injects the whole blocks, the engine computes the rest. The
# base model prefills the first prompts, the Dual-Flow checkpoint with its aux flow off the next, a Dual-Flow engine
# (aux flow on: its aux layers run and must save nothing) the last ones.
BASE_PROMPTS = random_prompts([40, 71, 33], seed=5)
PRIMARY_ONLY_PROMPTS = random_prompts([50], seed=7)
DUAL_FLOW_PROMPTS = random_prompts([45, 38], seed=6)
PROMPTS = BASE_PROMPTS + PRIMARY_ONLY_PROMPTS + DUAL_FLOW_PROMPTS
MAX_NEW_TOKENS = 8
BLOCK_SIZE = ENGINE_ARGS["block_size"]
# Another Qwen3-MoE: one layer, head size 64 instead of 32.
OTHER_MODEL = SOURCE | dict(num_hidden_layers=1, num_attention_heads=2, head_dim=64)


def connector(role: str, storage) -> dict:
    config = {"kv_connector": "ExampleConnector", "kv_role": role}
    return {"kv_transfer_config": {**config, "kv_connector_extra_config": {"shared_storage_path": str(storage)}}}


def prefill(model, prompts, storage, **engine_args) -> None:
    # The ExampleConnector stores what a request's first step computes: the producer prefills each prompt in one step.
    whole_prompts = dict(max_num_batched_tokens=sum(map(len, prompts)))
    with running_engine(model, **whole_prompts, **engine_args, **connector("kv_producer", storage)) as producer:
        served_greedy(producer, prompts, max_new_tokens=1)


def tokens_of(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture(scope="module")
def storage(checkpoint, engines, tmp_path_factory):
    """The prompts' KV, written by the three kinds of producer."""
    engines.close()  # one CPU engine at a time (conftest.py)
    storage = tmp_path_factory.mktemp("kv")
    prefill(checkpoint.parent / "source", BASE_PROMPTS, storage, tokenizer=str(checkpoint))
    prefill(checkpoint, PRIMARY_ONLY_PROMPTS, storage, hf_overrides={"use_aux_flow": False})
    prefill(checkpoint, DUAL_FLOW_PROMPTS, storage)
    return storage


def test_base_model_prefill_then_dual_flow_decode(checkpoint, storage):
    saved = [path.name for path in storage.rglob("*.safetensors")]
    assert len(saved) == 2 * len(PROMPTS) and not any("aux" in name for name in saved)

    reference = load_reference(checkpoint)
    # prefix caching off: each run loads the prompts' KV from the connector, not from the engine's own cache
    with running_engine(checkpoint, enable_prefix_caching=False, **connector("kv_consumer", storage)) as consumer:
        # the engine configuration swapped in the subclass that skips the aux (KV-sharing) layers
        assert type(get_kv_transfer_group()).__name__ == "DualFlowExampleConnector"
        consumer.apply_model(record_attention_calls)
        outputs = served_greedy(consumer, PROMPTS, MAX_NEW_TOKENS)
        assert_matches_transformers(outputs, PROMPTS, reference, MAX_NEW_TOKENS)
        # Once every prompt is in, the steps load and save nothing: each runs the one-piece path, whose layers call
        # the aux attention alone (both flows' queries), not the primary layer's.
        primary, aux = "model.layers.0.self_attn.attn", "model.aux_attn.0"
        calls = [name for name, _, _ in consumer.apply_model(recorded_attention_calls)[0] if name in (primary, aux)]
        after_last_prefill = calls[len(calls) - calls[::-1].index(primary) :]
        assert after_last_prefill == [aux] * len(after_last_prefill)
        assert len(after_last_prefill) >= MAX_NEW_TOKENS - 1
        # the tokens come from the loaded KV: with the primary layer 0's keys and values scaled, they change
        layer_0 = {path: load_file(path) for path in storage.rglob("*layers.0.self_attn.attn.safetensors")}
        try:
            for path, tensors in layer_0.items():
                save_file({"kv_cache": 3.0 * tensors["kv_cache"]}, path)
            changed = served_greedy(consumer, PROMPTS, MAX_NEW_TOKENS)
        finally:  # the other tests read these files
            for path, tensors in layer_0.items():
                save_file(tensors, path)
    assert tokens_of(outputs) != tokens_of(changed)


def test_rounds_and_adapters_with_prefix_caching(adapter_checkpoint, checkpoint, storage):
    # the adapter checkpoint is a conversion of the same source model: the base model's KV is its primary flow's
    source, same_source = (
        load_file(folder.parent / "source" / "model.safetensors") for folder in (checkpoint, adapter_checkpoint)
    )
    assert all(torch.equal(source[name], same_source[name]) for name in source)

    reference = load_reference(adapter_checkpoint)
    with running_engine(
        adapter_checkpoint, enable_prefix_caching=True, **connector("kv_consumer", storage)
    ) as consumer:
        first = served_greedy(consumer, PROMPTS, MAX_NEW_TOKENS)
        again = served_greedy(consumer, PROMPTS, MAX_NEW_TOKENS)  # the whole blocks are in the engine's cache now
    assert_matches_transformers(first, PROMPTS, reference, MAX_NEW_TOKENS)
    assert tokens_of(again) == tokens_of(first)


def test_kv_of_another_model_is_refused(checkpoint, storage, tmp_path, caplog):
    other = tmp_path / "other-model"
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**OTHER_MODEL)).save_pretrained(other)
    foreign = tmp_path / "kv"
    other_prompts = random_prompts([40, 50], seed=8)
    prefill(other, other_prompts, foreign, tokenizer=str(checkpoint))
    with running_engine(checkpoint, enable_prefix_caching=False, **connector("kv_consumer", foreign)) as consumer:
        # and a producer with fewer layers: a prompt's files without layer 1's (the folder is named by its tokens)
        prompt = BASE_PROMPTS[0]
        whole_blocks = torch.tensor(prompt[: (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE])
        folder = Path(get_kv_transfer_group()._generate_foldername_debug(whole_blocks, []))
        shutil.copytree(storage / folder.name, foreign / folder.name)
        (foreign / folder.name / "model.layers.1.self_attn.attn.safetensors").unlink()
        caplog.clear()
        refused = served_greedy(consumer, other_prompts + [prompt], MAX_NEW_TOKENS)
    # vLLM's kv_load_failure_policy ("fail" by default) ends each request with an error instead of serving it
    assert [(output.outputs[0].finish_reason, list(output.outputs[0].token_ids)) for output in refused] == [
        ("error", [])
    ] * 3
    log = caplog.text
    assert "KV of a 32-token prompt not loaded: layer model.layers.0.self_attn.attn holds KV of shape" in log
    assert "the producer wrote no KV for layer model.layers.1.self_attn.attn (a model with fewer layers)" in log

    # with kv_load_failure_policy "recompute" the engine computes those prompts itself: the Dual-Flow engine's tokens
    recompute = connector("kv_consumer", foreign)
    recompute["kv_transfer_config"]["kv_load_failure_policy"] = "recompute"
    with running_engine(checkpoint, enable_prefix_caching=False, **recompute) as consumer:
        recomputed = served_greedy(consumer, other_prompts + [prompt], MAX_NEW_TOKENS)
    assert_matches_transformers(recomputed, other_prompts + [prompt], load_reference(checkpoint), MAX_NEW_TOKENS)


# Two requests share a two-block prefix; a third with the same prefix, 40 tokens past it, finds the prefix's two blocks
# in the engine's cache and one more block in the connector's files.
PREFIX = random_prompts([2 * BLOCK_SIZE], seed=9)[0]
SHARING = [PREFIX + suffix for suffix in random_prompts([10, 12, 40], seed=10)]


def serve_third_while_two_run(consumer) -> dict[str, tuple[str, list[int]]]:
    """The first two prompts of SHARING prefilled and decoding, then the third added: each request's finish reason and
    tokens, by prompt index."""
    from vllm import SamplingParams

    engine = consumer.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    for i in (0, 1):
        engine.add_request(str(i), {"prompt_token_ids": SHARING[i]}, params)
    finished = {}
    for step in range(100):
        if step == 1:  # the first two were prefilled in step 0 and run
            engine.add_request("2", {"prompt_token_ids": SHARING[2]}, params)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = (output.outputs[0].finish_reason, list(output.outputs[0].token_ids))
        if step > 0 and not engine.has_unfinished_requests():
            return finished
    raise AssertionError("the requests did not finish")


def prefix_cache_hits(consumer) -> float:
    return sum(metric.value for metric in consumer.get_metrics() if metric.name == "vllm:prefix_cache_hits")


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_refused_file_fails_only_its_request_when_other_requests_share_its_cached_prefix(
    checkpoint, tmp_path, policy, caplog
):
    reference = load_reference(checkpoint)
    alone = [hf_greedy(reference, prompt, MAX_NEW_TOKENS)[0] for prompt in SHARING]
    options = connector("kv_consumer", tmp_path)
    options["kv_transfer_config"]["kv_load_failure_policy"] = policy
    budget = dict(max_num_batched_tokens=256)  # both first prompts prefilled in one step
    caplog.clear()
    with running_engine(
        checkpoint, enable_prefix_caching=True, disable_log_stats=False, **budget, **options
    ) as consumer:
        # The third prompt's files: KV of another shape per token (another model's), for its three whole blocks.
        third = SHARING[2]
        whole_blocks = torch.tensor(third[: (len(third) - 1) // BLOCK_SIZE * BLOCK_SIZE])
        folder = Path(get_kv_transfer_group()._generate_foldername_debug(whole_blocks, [], create_folder=True))
        for layer in range(SOURCE["num_hidden_layers"]):
            path = folder / f"model.layers.{layer}.self_attn.attn.safetensors"
            save_file({"kv_cache": torch.zeros(len(whole_blocks), 2, 1, 64)}, path)
        finished = serve_third_while_two_run(consumer)
        # The third request found the two prefix blocks in the engine's own cache (the first two requests' blocks).
        assert prefix_cache_hits(consumer) >= 2 * BLOCK_SIZE
    assert "KV of a 96-token prompt not loaded: layer model.layers.0.self_attn.attn holds KV of shape" in caplog.text
    # The requests sharing the cached prefix finish with the tokens they have alone.
    assert [finished[str(i)] for i in (0, 1)] == [("length", alone[0]), ("length", alone[1])]
    # The third ends with an error ("fail") or computes its block itself ("recompute").
    assert finished["2"] == (("error", []) if policy == "fail" else ("length", alone[2]))


# How long the producer may take to start and prefill (about 30 s here, alone); past it the test fails with the
# producer's Python stacks (faulthandler, on SIGUSR1) and its last output, instead of waiting for pytest's timeout.
PRODUCER_ANSWER_S = 300


@contextmanager
def nixl_producer(model, tokenizer):
    """A vLLM engine on `model` as the NixlConnector's producer, in a process of its own (nixl_producer.py): a function
    that prefills prompts there and returns each prompt's `kv_transfer_params` for the consumer."""
    env = os.environ | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    command = [sys.executable, str(Path(__file__).with_name("nixl_producer.py")), str(model), str(tokenizer)]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    lines = queue.Queue()

    def read_all():  # on a thread of its own, all along: the producer never waits on a full pipe
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read_all, daemon=True).start()
    output = []

    def prefill(prompts: list[list[int]]) -> list[dict]:
        process.stdin.write(json.dumps(prompts) + "\n")
        process.stdin.flush()
        deadline = time.monotonic() + PRODUCER_ANSWER_S
        while True:
            try:
                line = lines.get(timeout=max(0, deadline - time.monotonic()))
            except queue.Empty:
                process.send_signal(signal.SIGUSR1)  # its stacks, to stderr (captured with the test's)
                tail = "".join(output[-20:])
                raise AssertionError(
                    f"the NIXL producer did not answer in {PRODUCER_ANSWER_S} s; it wrote:\n{tail}"
                ) from None
            if line is None:
                raise RuntimeError(f"the NIXL producer exited with {process.wait()}")
            if line.startswith(PARAMS_LINE):
                return json.loads(line.removeprefix(PARAMS_LINE))
            output.append(line)

    try:
        yield prefill
    finally:
        process.stdin.close()  # it shuts its engine down when its input ends
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:  # NIXL's agent threads can hold that shutdown for minutes
            stop_session(process, 10)


def nixl_consumer(**extra_config) -> dict:
    config = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}
    return {"kv_transfer_config": config | {"kv_connector_extra_config": extra_config}}


def decode_after_remote_prefill(consumer, prompts, kv_transfer_params):
    """The consumer's greedy completions of prompts the producer prefilled (what vLLM's proxy sends the consumer)."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=MAX_NEW_TOKENS,
            logprobs=0,
            ignore_eos=True,
            extra_args={"kv_transfer_params": transfer},
        )
        for transfer in kv_transfer_params
    ]
    return consumer.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture
def keep_cpu_affinity():
    # The NIXL worker pins the thread that starts a CPU engine (this one: the engine runs in-process) to one core per
    # NUMA node, for its transfers; the tests after this one get every core back.
    cores = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, cores)


def test_base_model_prefill_then_dual_flow_decode_over_nixl(
    checkpoint, engines, caplog, monkeypatch, keep_cpu_affinity
):
    engines.close()  # one CPU engine in this process at a time (conftest.py)
    source = checkpoint.parent / "source"
    reference = load_reference(checkpoint)
    primary_layers = {f"model.layers.{i}.self_attn.attn" for i in range(SOURCE["num_hidden_layers"])}
    with nixl_producer(source, tokenizer=checkpoint) as prefill:
        # Told nothing, the consumer takes KV from engines serving its own checkpoint only: vLLM's handshake refuses
        # the base model's engine (its compatibility hash names the model), and the requests end with an error.
        with running_engine(checkpoint, **nixl_consumer()) as consumer:
            # vLLM's log (configured as an engine starts) goes to the root logger too, where caplog reads
            monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
            caplog.clear()
            refused = decode_after_remote_prefill(consumer, BASE_PROMPTS, prefill(BASE_PROMPTS))
        assert [(output.outputs[0].finish_reason, list(output.outputs[0].token_ids)) for output in refused] == [
            ("error", [])
        ] * len(BASE_PROMPTS)
        assert "NIXL compatibility hash mismatch" in caplog.text

        # Named as its producer, the base model's engine is accepted (its hash, everything else the consumer's own).
        with running_engine(checkpoint, **nixl_consumer(producer_model=str(source))) as consumer:
            connector = get_kv_transfer_group()
            assert type(connector).__name__ == "DualFlowNixlConnector"
            # the primary layers' pages are registered with NIXL, the aux (KV-sharing) layers' are not
            assert set(connector.connector_worker.device_kv_caches) == primary_layers
            consumer.apply_model(record_attention_calls)
            outputs = decode_after_remote_prefill(consumer, BASE_PROMPTS, prefill(BASE_PROMPTS))
            calls = consumer.apply_model(recorded_attention_calls)[0]
    assert_matches_transformers(outputs, BASE_PROMPTS, reference, MAX_NEW_TOKENS)
    # The prompts' KV came over NIXL: the consumer computed one row of each prompt (its last token: vLLM recomputes
    # it to sample), then decoded, every step on the one-piece path (the aux layers' calls, both flows' heads).
    assert not [call for call in calls if call[0] in primary_layers]
    rows = [rows for name, rows, _ in calls if name == "model.aux_attn.0"]
    assert sum(rows) == len(BASE_PROMPTS) * MAX_NEW_TOKENS


@pytest.mark.parametrize("name", ["LMCacheConnectorV1", "OffloadingConnector", "MooncakeConnector"])
def test_untested_connectors_are_refused_in_one_line(name):
    from vllm.config.kv_transfer import KVTransferConfig

    from dualflow.serving.kv_transfer import use_connector_without_kv_sharing_layers

    message = rf"runs the KV connector ExampleConnector or NixlConnector only \(tested\), not '{name}'"
    with pytest.raises(ValueError, match=message) as e:
        use_connector_without_kv_sharing_layers(KVTransferConfig(kv_connector=name, kv_role="kv_both"))
    assert "\n" not in str(e.value)
