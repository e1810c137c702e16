"""Decode against the limit: a roofline for vLLM's V1 runner on this CPU, and the GPU prediction (issue 63).

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/decode_roofline.py            # CPU, a few minutes
    python benchmarks/decode_roofline.py --gpu-prediction                            # the H100 table only, no vLLM

A random Qwen3-MoE built with transformers' own class (hidden 512, 4 layers, 16 experts of 896, k_p = 2, 32k vocab,
float32) and its conversion by `dualflow.convert.convert_checkpoint` (couplings perturbed, as after fine-tuning), four
vLLM engines in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, eager): vLLM's native Qwen3-MoE on the source
weights, the Dual-Flow engine with the aux flow off (`use_aux_flow: false`), on with k_a = k_p and with k_a = 2 k_p.
Hooks put on each engine's model (`llm.apply_model`) record, per forward step, the time the step's model forward and
LM head took (the engine thread's CPU time: with one torch thread that is the work done, whatever else the machine
runs; wall time beside it) and, per MoE layer, the experts each flow's rows route to (the block's router on its input,
top-k_p for primary rows, top-k_a for aux rows; the hook's own time is taken out of the step's).

Per decode step the byte/FLOP model (`step_cost`) counts what the step must touch at the least: every distinct
expert either flow routes to (once), every other weight once (attention, router, norms, couplings, LM head), the
embedding rows of the step's tokens (and aux embedding rows), the K/V read at each request's context (once: the
Dual-Flow step reads the pages in one 2H-head call) and written for the new token; FLOPs = 2 x rows x weights each row
touches + attention over the context (QK and PV) + the LM head on the rows that get logits (one per request in every
arm). Roofline time = max(bytes / B, flops / F) and, beside it, the sum; B and F are calibrated in the same process,
same thread count, same clock (`calibrate`).

`--compiled`: each arm also on vLLM's default engine (compiled, not eager), run right after its eager twin on the same
prompts and timed by the same hooks; its MoE blocks run inside the compiled graph, where the routing hooks never fire,
so its rooflines are the eager twin's (greedy decoding on the same weights: the same tokens, the same routes).

`--gpu-prediction` (and `gpu_prediction()`, which benchmarks/gpu_check.py prints as the number to meet): the same
byte model for a Qwen3-30B-A3B shape in bf16 at an H100's 3.35 TB/s, distinct experts per layer taken as their
expectation under uniform independent routing (a bound: real routing is skewed, so real steps touch fewer).
"""

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path


# ----------------------------------------------------------------------------------------------------------------------
# The byte / FLOP model (pure Python: the tests and gpu_check import it without torch or vLLM doing anything)


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    expert_size: int  # moe_intermediate_size
    vocab: int
    top_k: int
    bytes_per_param: int
    tied_embeddings: bool = False

    @property
    def expert_params(self) -> int:  # gate, up, down
        return 3 * self.hidden * self.expert_size

    @property
    def attention_params(self) -> int:  # q, k, v, o projections
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @property
    def layer_dense_params(self) -> int:
        """Per layer, what every row reads besides experts: attention projections, router, two RMSNorms, q/k norms."""
        return self.attention_params + self.hidden * self.experts + 2 * self.hidden + 2 * self.head_dim

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.bytes_per_param

    def checkpoint_params(self, aux: bool) -> int:
        """Every parameter of the source model (aux=False) or of its Dual-Flow conversion (aux embedding, couplings)."""
        per_layer = self.layer_dense_params + self.experts * self.expert_params + (self.hidden if aux else 0)
        embeddings = self.vocab * self.hidden * ((1 if self.tied_embeddings else 2) + (1 if aux else 0))
        return self.layers * per_layer + embeddings + self.hidden


# Qwen3-30B-A3B (its config.json on the Hub: 48 layers, hidden 2048, 32 / 4 heads of 128, 128 experts of 768, top-8,
# vocab 151936, untied embeddings), in bf16.
QWEN3_30B_A3B = Shape(
    layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, expert_size=768, vocab=151936,
    top_k=8, bytes_per_param=2,
)  # fmt: skip
# H100 SXM5 HBM3: 3.35 TB/s (NVIDIA's H100 datasheet, "GPU memory bandwidth", SXM form factor).
H100_BYTES_PER_SECOND = 3.35e12
# The CPU model measured here (16 experts of 896: the CPU preset's expert bytes, Qwen3-like finer experts).
CPU_SHAPE = Shape(
    layers=4, hidden=512, heads=8, kv_heads=2, head_dim=64, experts=16, expert_size=896, vocab=32000, top_k=2,
    bytes_per_param=4,
)  # fmt: skip


def expected_distinct(experts: int, picks: list[tuple[int, int]]) -> float:
    """
    Expected distinct experts a layer streams when `rows` rows each pick `k` distinct experts uniformly at random,
    independently, for each (rows, k) in `picks`: E x (1 - prod (1 - k / E)^rows). A bound on the bytes: real
    routing is skewed towards some experts, so real rows share more.
    """
    missed = math.prod((1 - k / experts) ** rows for rows, k in picks)
    return experts * (1 - missed)


def step_cost(
    shape: Shape, distinct_experts: float, contexts: list[int], aux: bool, aux_top_k: int | None = None
) -> tuple[float, float]:
    """
    (bytes, FLOPs) a decode step must touch at the least. `distinct_experts`: summed over the layers, the experts
    either flow routes to; `contexts`: each request's context (tokens its K/V holds, this step's included); `aux`: the
    aux flow runs (one aux row per request, k_a = `aux_top_k` experts, its embedding row and per-channel couplings).
    The K/V pages are read once (the Dual-Flow step attends both flows in one call); the new token's K/V written once.
    The LM head runs on one row per request in every arm (with the aux flow on, on the aux rows only).
    """
    batch = len(contexts)
    p = shape.bytes_per_param
    k_a = shape.top_k if aux_top_k is None else aux_top_k
    rows = batch * (2 if aux else 1)
    weights = shape.layers * shape.layer_dense_params + distinct_experts * shape.expert_params
    weights += shape.hidden  # final norm
    weights += shape.vocab * shape.hidden  # LM head (the embedding itself when tied)
    weights += batch * shape.hidden * (2 if aux else 1)  # embedding rows (and aux embedding rows)
    if aux:
        weights += shape.layers * shape.hidden  # couplings
    context = sum(contexts)
    kv = shape.layers * shape.kv_bytes_per_token_layer * (context + batch)  # read all, write the new token's
    bytes_ = weights * p + kv
    flops = 2 * rows * shape.layers * shape.layer_dense_params
    flops += 2 * shape.layers * shape.expert_params * batch * (shape.top_k + (k_a if aux else 0))
    flops += 4 * shape.layers * shape.heads * shape.head_dim * context * (2 if aux else 1)  # QK^T and PV per row
    flops += 2 * batch * shape.vocab * shape.hidden
    return float(bytes_), float(flops)


def roofline_seconds(bytes_: float, flops: float, bandwidth: float, flop_rate: float, overlap: bool = True) -> float:
    """max(bytes / B, flops / F) where the machine overlaps memory and arithmetic, their sum where it does not."""
    memory, compute = bytes_ / bandwidth, flops / flop_rate
    return max(memory, compute) if overlap else memory + compute


def gpu_prediction(
    batches=(1, 8, 32, 64),
    contexts=(512, 4096),
    shape: Shape = QWEN3_30B_A3B,
    bandwidth: float = H100_BYTES_PER_SECOND,
) -> list[dict]:
    """
    Bandwidth-bound decode (time = bytes / bandwidth) of `shape` aux on / off, per batch, context and k_a in
    (k_p, 2 k_p), distinct experts per layer as expected under uniform independent routing. The ratio is the aux-off
    step time over the aux-on one (tokens/s aux on / off, as the vLLM tables give it): what a GPU should reach.
    """
    rows = []
    for context in contexts:
        for batch in batches:
            off_experts = shape.layers * expected_distinct(shape.experts, [(batch, shape.top_k)])
            off, _ = step_cost(shape, off_experts, [context] * batch, aux=False)
            for label, k_a in (("k_a=k_p", shape.top_k), ("k_a=2k_p", 2 * shape.top_k)):
                on_experts = shape.layers * expected_distinct(shape.experts, [(batch, shape.top_k), (batch, k_a)])
                on, _ = step_cost(shape, on_experts, [context] * batch, aux=True, aux_top_k=k_a)
                rows.append(
                    dict(
                        context=context, batch=batch, arm=label, ratio=off / on,
                        off_ms=off / bandwidth * 1e3, on_ms=on / bandwidth * 1e3,
                        experts_off=off_experts / shape.layers, experts_on=on_experts / shape.layers,
                    )
                )  # fmt: skip
    return rows


def gpu_prediction_table() -> str:
    lines = [
        f"Qwen3-30B-A3B shape, bf16, bandwidth-bound at {H100_BYTES_PER_SECOND / 1e12:.2f} TB/s (H100 SXM), "
        "uniform independent routing (rows share experts by chance only: real, skewed routing shares more)",
        "| context | batch | arm | experts/layer off / on | step ms off / on | aux on / off tokens/s |",
        "| ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in gpu_prediction():
        lines.append(
            f"| {r['context']} | {r['batch']} | {r['arm']} | {r['experts_off']:.1f} / {r['experts_on']:.1f} | "
            f"{r['off_ms']:.2f} / {r['on_ms']:.2f} | {r['ratio']:.3f} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# The measurement (vLLM, in this process)

ARMS = ("native Qwen3-MoE", "dual aux off", "dual k_a=k_p", "dual k_a=2k_p")


class Recorder:
    """Hooks on one engine's model: per forward step its rows, times and, per MoE layer, each flow's experts."""

    def __init__(self, top_k: int, aux_top_k: int):
        self.top_k, self.aux_top_k = top_k, aux_top_k
        self.steps = []
        self.current = None
        self.routing = True  # off while profiling: the routes' own router calls would count as the model's ops

    def install(self, model):
        import torch

        def start(module, args, kwargs):
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            self.current = dict(rows=int(input_ids.shape[0]), cpu=0.0, wall=0.0, hook_cpu=0.0, hook_wall=0.0)
            self.current["routes"] = []
            self.current["t"] = (time.thread_time(), time.perf_counter())

        def stop(module, args, kwargs, output):
            cpu, wall = self.current.pop("t")
            self.current["cpu"] += time.thread_time() - cpu
            self.current["wall"] += time.perf_counter() - wall
            self.steps.append(self.current)

        def route(module, args, kwargs):
            if not self.routing or self.current is None or "t" not in self.current:
                return
            cpu, wall = time.thread_time(), time.perf_counter()
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            num_primary = kwargs.get("num_primary", args[1] if len(args) > 1 else hidden.shape[0])
            with torch.no_grad():
                logits = module.gate(hidden)
                logits = logits[0] if isinstance(logits, tuple) else logits
                primary = logits[:num_primary].topk(self.top_k, dim=-1).indices.flatten().tolist()
                aux = logits[num_primary:].topk(self.aux_top_k, dim=-1).indices.flatten().tolist()
            self.current["routes"].append((int(num_primary), int(hidden.shape[0] - num_primary), primary, aux))
            self.current["hook_cpu"] += time.thread_time() - cpu
            self.current["hook_wall"] += time.perf_counter() - wall

        model.register_forward_pre_hook(start, with_kwargs=True)
        model.register_forward_hook(stop, with_kwargs=True)
        for module in model.modules():
            if type(module).__name__ in ("DualFlowSparseMoeBlock", "Qwen3MoeSparseMoeBlock"):
                module.register_forward_pre_hook(route, with_kwargs=True)
        compute_logits = model.compute_logits

        def timed_logits(hidden_states):
            cpu, wall = time.thread_time(), time.perf_counter()
            out = compute_logits(hidden_states)
            if self.steps:
                self.steps[-1]["cpu"] += time.thread_time() - cpu
                self.steps[-1]["wall"] += time.perf_counter() - wall
            return out

        model.compute_logits = timed_logits
        return torch.get_num_threads()

    def take(self, batch: int) -> list[dict]:
        """The decode steps recorded since the last call (every row one request's next token), then forget them."""
        steps, self.steps = self.steps, []
        if not self.routing:  # a compiled engine: its MoE blocks run inside the graph, the routing hooks never fire
            return [s for s in steps if s["rows"] == batch]
        return [s for s in steps if s["rows"] == batch and s["routes"] and all(r[0] == batch for r in s["routes"])]


def calibrate(shape: Shape, repeats: int = 7) -> dict:
    """
    B: a GEMV over a float32 matrix of 256 MiB, hidden columns (the decode step's expert weights, batch 1: each
    weight read once, from memory, not cache); F: a GEMM of the expert's shapes at 256 rows (compute bound, its
    weights in cache). Median of `repeats`, the engine thread's clock (thread CPU time), this process's threads.
    A copy (read + write) is reported beside B.
    """
    import torch

    def timed(fn):
        fn()
        samples = []
        for _ in range(repeats):
            start = time.thread_time()
            fn()
            samples.append(time.thread_time() - start)
        return statistics.median(samples)

    matrix = torch.randn(2**26 // shape.hidden, shape.hidden)
    vector = torch.randn(shape.hidden)
    gemv = timed(lambda: torch.mv(matrix, vector))
    copy_target = torch.empty_like(matrix)
    copy = timed(lambda: copy_target.copy_(matrix))
    rows = torch.randn(256, shape.hidden)
    weight = torch.randn(shape.hidden, 2 * shape.expert_size)
    gemm = timed(lambda: [rows @ weight for _ in range(20)])
    return dict(
        bandwidth=matrix.numel() * 4 / gemv,
        copy_bandwidth=2 * matrix.numel() * 4 / copy,
        flop_rate=20 * 2 * 256 * shape.hidden * 2 * shape.expert_size / gemm,
        threads=torch.get_num_threads(),
    )


def build_checkpoints(root: Path, shape: Shape) -> dict:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from dualflow.convert import convert_checkpoint
    from modeling_dualflow import DualFlowForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.expert_size,
        moe_intermediate_size=shape.expert_size,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        tie_word_embeddings=shape.tied_embeddings,
        max_position_embeddings=4096,
    )
    source = Qwen3MoeForCausalLM(config)
    assert sum(p.numel() for p in source.parameters()) == shape.checkpoint_params(aux=False), "shape != checkpoint"
    source.save_pretrained(root / "source")
    convert_checkpoint(root / "source", root / "converted", aux_top_k=shape.top_k, show_progress=False)
    model = DualFlowForCausalLM.from_pretrained(root / "converted")
    with torch.no_grad():  # an aux flow that routes otherwise than the primary one, as after fine-tuning
        for layer in model.model.layers:
            layer.aux_coupling.weight.normal_(std=0.1)
    assert sum(p.numel() for p in model.parameters()) == shape.checkpoint_params(aux=True), "shape != conversion"
    model.save_pretrained(root / "dualflow")
    return {"source": root / "source", "dualflow": root / "dualflow"}


def step_roofline(shape: Shape, step: dict, prompt: int, index: int, arm: str, calibration: dict) -> dict:
    """One recorded decode step: its distinct experts, bytes, FLOPs and both roofline times."""
    aux = arm.startswith("dual k_a")
    k_a = 2 * shape.top_k if arm.endswith("2k_p") else shape.top_k
    batch = step["rows"]
    distinct = sum(
        len(set(primary) | (set(aux_experts) if aux else set())) for _, _, primary, aux_experts in step["routes"]
    )
    contexts = [prompt + index] * batch  # step i (0-based) of decode attends to the prompt and the i + 1 tokens since
    bytes_, flops = step_cost(shape, distinct, contexts, aux=aux, aux_top_k=k_a)
    bandwidth, flop_rate = calibration["bandwidth"], calibration["flop_rate"]
    return dict(
        experts=distinct / shape.layers,
        bytes=bytes_,
        flops=flops,
        max=roofline_seconds(bytes_, flops, bandwidth, flop_rate, overlap=True),
        sum=roofline_seconds(bytes_, flops, bandwidth, flop_rate, overlap=False),
        cpu=step["cpu"] - step["hook_cpu"],
        wall=step["wall"] - step["hook_wall"],
    )


def median_se(values: list[float]) -> tuple[float, float]:
    """Median and the standard error of the mean (the rounds' spread / sqrt(n))."""
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return statistics.median(values), se


def measure(args):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the hooks' records are ours
    import tempfile

    import torch
    from vllm import LLM, SamplingParams

    shape = CPU_SHAPE
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="dualflow-roofline-") as folder:
        paths = build_checkpoints(Path(folder), shape)
        engine_args = dict(
            dtype="float32",
            max_model_len=args.prompt + args.decode_tokens + 16,
            max_num_batched_tokens=max(2048, max(args.batches) * (args.prompt + 16)),
            enable_prefix_caching=False,
            enforce_eager=True,
            skip_tokenizer_init=True,
            seed=0,
        )
        served = {
            "native Qwen3-MoE": (paths["source"], {}),
            "dual aux off": (paths["dualflow"], {"use_aux_flow": False}),
            "dual k_a=k_p": (paths["dualflow"], {"aux_num_experts_per_tok": shape.top_k}),
            "dual k_a=2k_p": (paths["dualflow"], {"aux_num_experts_per_tok": 2 * shape.top_k}),
        }
        engines, recorders, threads = {}, {}, {}
        compiled, compiled_recorders = {}, {}
        for arm, (path, override) in served.items():
            engines[arm] = LLM(model=str(path), hf_overrides=override, **engine_args)
            aux_top_k = 2 * shape.top_k if arm.endswith("2k_p") else shape.top_k
            recorders[arm] = Recorder(shape.top_k, aux_top_k)
            threads[arm] = engines[arm].apply_model(recorders[arm].install)[0]
            if args.compiled:  # vLLM's default engine beside the eager one; its steps are timed, not routed
                compiled[arm] = LLM(model=str(path), hf_overrides=override, **engine_args | {"enforce_eager": False})
                compiled_recorders[arm] = Recorder(shape.top_k, aux_top_k)
                compiled_recorders[arm].routing = False
                compiled[arm].apply_model(compiled_recorders[arm].install)
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
        generator = torch.Generator().manual_seed(1)

        def run(engine, prompts) -> list[list[int]]:
            outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [list(output.outputs[0].token_ids) for output in outputs]

        for arm in ARMS:  # warm-up
            warm_up = torch.randint(0, shape.vocab, (1, 16), generator=generator).tolist()
            for engine, recorder in ((engines, recorders), (compiled, compiled_recorders)):
                if arm in engine:
                    run(engine[arm], warm_up)
                    recorder[arm].take(1)
        calibration = calibrate(shape)
        # per (batch, arm): per round, the medians over its decode steps
        results = {(b, arm): [] for b in args.batches for arm in ARMS}
        compiled_results = {(b, arm): [] for b in args.batches for arm in compiled}
        for round_index in range(args.rounds):
            for batch in args.batches:
                prompts = torch.randint(0, shape.vocab, (batch, args.prompt), generator=generator).tolist()
                for arm in ARMS[round_index % len(ARMS) :] + ARMS[: round_index % len(ARMS)]:
                    tokens = run(engines[arm], prompts)
                    steps = recorders[arm].take(batch)
                    per_step = [step_roofline(shape, s, args.prompt, i, arm, calibration) for i, s in enumerate(steps)]
                    results[batch, arm].append(
                        {key: statistics.median(s[key] for s in per_step) for key in per_step[0]}
                    )
                    if arm in compiled:  # the same prompts: greedy, so the eager twin's routes and rooflines
                        same = sum(a == b for a, b in zip(tokens, run(compiled[arm], prompts)))
                        times = compiled_recorders[arm].take(batch)
                        assert len(times) == len(per_step), f"{arm}: {len(times)} compiled steps, {len(per_step)} eager"
                        compiled_results[batch, arm].append(
                            {
                                "cpu": statistics.median(t["cpu"] for t in times),
                                "wall": statistics.median(t["wall"] for t in times),
                                "max": results[batch, arm][-1]["max"],
                                "sum": results[batch, arm][-1]["sum"],
                                "same_tokens": same / batch,
                            }
                        )
            load.append(os.getloadavg())
            print(f"round {round_index + 1}/{args.rounds} done, load {load[-1][0]:.2f}", flush=True)
        if args.profile:
            profile(args, engines, recorders, torch.randint(0, shape.vocab, (args.profile, args.prompt)).tolist())
        for engine in engines.values():
            del engine
    if args.rounds:
        report(args, shape, calibration, results, load, threads)
        if compiled:
            report_compiled(args, results, compiled_results)


def profile(args, engines, recorders, prompts):
    """
    torch profiler, batch `--profile`, each arm: the prompts are prefilled unprofiled (engine steps until every request
    has its first token), then the decode steps alone are profiled; self CPU time per op per decode step.
    """
    import itertools

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from vllm import SamplingParams

    request_ids = itertools.count()
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    for recorder in recorders.values():
        recorder.routing = False

    def self_ms(arm):
        engine = engines[arm].llm_engine
        for prompt in prompts:
            engine.add_request(f"profile-{next(request_ids)}", {"prompt_token_ids": prompt}, params)
        prefilled = set()
        while len(prefilled) < len(prompts):
            prefilled.update(output.request_id for output in engine.step() if output.outputs[0].token_ids)
        steps = 0
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
        return {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}

    samples = {arm: [] for arm in ARMS}
    for repeat in range(args.profile_repeats):
        for arm in ARMS[repeat % len(ARMS) :] + ARMS[: repeat % len(ARMS)]:
            samples[arm].append(self_ms(arm))
    # per op, the median over the repeats (arms rotated every repeat)
    per_arm = {
        arm: {op: statistics.median(r.get(op, 0) for r in runs) for op in set().union(*runs)}
        for arm, runs in samples.items()
    }
    for arm, runs in samples.items():
        totals = [sum(r.values()) for r in runs]
        print(f"profile {arm}: total per repeat " + ", ".join(f"{t:.2f}" for t in totals) + " ms")
    ops = sorted(set().union(*per_arm.values()), key=lambda op: -max(arm.get(op, 0) for arm in per_arm.values()))
    print(
        f"\nprofile, batch {len(prompts)}, {args.prompt}-token prompts: self CPU ms per decode step (the decode steps "
        "of each run alone, prefill unprofiled; the profiler's own overhead included)"
    )
    print("| op | " + " | ".join(ARMS) + " |")
    print("| --- |" + " ---: |" * len(ARMS))
    for op in ops[:25]:
        print(f"| {op} | " + " | ".join(f"{per_arm[arm].get(op, 0):.3f}" for arm in ARMS) + " |")
    print("| total | " + " | ".join(f"{sum(per_arm[arm].values()):.3f}" for arm in ARMS) + " |")


def print_aux_ratios(batches: list[int], results: dict) -> None:
    """Aux on / off per batch and arm: predicted by each roofline and measured, paired per round."""
    print("| batch | arm | predicted (max) | predicted (sum) | measured | measured / predicted (max) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for batch in batches:
        off = results[batch, "dual aux off"]
        for arm in ("dual k_a=k_p", "dual k_a=2k_p"):
            on = results[batch, arm]
            pred_max = [a["max"] / b["max"] for a, b in zip(off, on)]
            pred_sum = [a["sum"] / b["sum"] for a, b in zip(off, on)]
            measured = [a["cpu"] / b["cpu"] for a, b in zip(off, on)]
            gap = [m / p for m, p in zip(measured, pred_max)]
            cells = [median_se(x) for x in (pred_max, pred_sum, measured, gap)]
            print(f"| {batch} | {arm} | " + " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in cells) + " |")


def report(args, shape, calibration, results, load, threads):
    print(
        f"\nmodel: Qwen3-MoE hidden {shape.hidden}, {shape.layers} layers, {shape.experts} experts of "
        f"{shape.expert_size}, k_p = {shape.top_k}, vocab {shape.vocab}, float32; prompts {args.prompt} tokens, "
        f"{args.decode_tokens} generated; {args.rounds} rounds, arms in an order rotated every round; torch threads in "
        f"the engines {sorted(set(threads.values()))}; load average (1 min) over the run "
        f"{min(x[0] for x in load):.2f}-{max(x[0] for x in load):.2f}"
    )
    print(
        f"calibration (thread CPU time, {calibration['threads']} thread(s)): B = {calibration['bandwidth'] / 1e9:.2f} "
        f"GB/s (GEMV over 256 MiB; a copy reads + writes at {calibration['copy_bandwidth'] / 1e9:.2f} GB/s), "
        f"F = {calibration['flop_rate'] / 1e9:.1f} GFLOP/s (GEMM 256 x {shape.hidden} x {2 * shape.expert_size})"
    )
    print(
        "\nPer decode step (median over a run's steps, then median over rounds ± SE of the rounds): measured = the "
        "engine thread's CPU time in the model forward + LM head; roofline max(bytes/B, flops/F) and the sum"
    )
    print(
        "| batch | arm | experts/layer | MB/step | MFLOP/step | measured ms (CPU) | wall ms "
        "| roofline max ms | measured / max | measured / sum |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (batch, arm), rounds in results.items():
        cpu, cpu_se = median_se([r["cpu"] * 1e3 for r in rounds])
        over_max, over_max_se = median_se([r["cpu"] / r["max"] for r in rounds])
        over_sum, over_sum_se = median_se([r["cpu"] / r["sum"] for r in rounds])
        print(
            f"| {batch} | {arm} | {statistics.median(r['experts'] for r in rounds):.2f} | "
            f"{statistics.median(r['bytes'] for r in rounds) / 1e6:.1f} | "
            f"{statistics.median(r['flops'] for r in rounds) / 1e6:.0f} | {cpu:.2f} ± {cpu_se:.2f} | "
            f"{statistics.median(r['wall'] for r in rounds) * 1e3:.2f} | "
            f"{statistics.median(r['max'] for r in rounds) * 1e3:.2f} | {over_max:.3f} ± {over_max_se:.3f} | "
            f"{over_sum:.3f} ± {over_sum_se:.3f} |"
        )
    print("\nAux on / off (tokens/s ratio = step time off / on; per round, paired, median ± SE)")
    print_aux_ratios(args.batches, results)
    native = [results[b, "native Qwen3-MoE"] for b in args.batches]
    for name in ("max", "sum"):
        ratios = [statistics.median(r["cpu"] / r[name] for r in rounds) for rounds in native]
        print(f"native measured / roofline ({name}) by batch {args.batches}: " + ", ".join(f"{x:.3f}" for x in ratios))


def report_compiled(args, eager, compiled):
    print(
        "\nvLLM's default (compiled) engine, each arm beside its eager twin on the same prompts; rooflines from the eager "
        "twin's routes (greedy decoding: the same tokens)"
    )
    print(
        "| batch | arm | requests with the eager twin's tokens | compiled ms (CPU) | wall ms | compiled / eager "
        "| measured / max | measured / sum |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (batch, arm), rounds in compiled.items():
        cpu, cpu_se = median_se([r["cpu"] * 1e3 for r in rounds])
        cells = [
            median_se([c["cpu"] / e["cpu"] for c, e in zip(rounds, eager[batch, arm])]),
            median_se([r["cpu"] / r["max"] for r in rounds]),
            median_se([r["cpu"] / r["sum"] for r in rounds]),
        ]
        same = statistics.mean(r["same_tokens"] for r in rounds)
        wall = statistics.median(r["wall"] for r in rounds) * 1e3
        print(
            f"| {batch} | {arm} | {same:.0%} | {cpu:.2f} ± {cpu_se:.2f} | {wall:.2f} | "
            + " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in cells)
            + " |"
        )
    print("\nAux on / off, compiled (step time off / on; per round, paired, median ± SE)")
    print_aux_ratios(args.batches, compiled)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--gpu-prediction", action="store_true", help="print the H100 prediction only (no vLLM)")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="also time each arm on vLLM's default compiled engine (twice the engines)",
    )
    parser.add_argument("--profile", type=int, metavar="BATCH", help="also profile decode runs per arm (torch)")
    parser.add_argument("--profile-repeats", type=int, default=3, help="profiled runs per arm, rotated")
    args = parser.parse_args()
    if args.gpu_prediction:
        print(gpu_prediction_table())
        return
    measure(args)
    print()
    print(gpu_prediction_table())


if __name__ == "__main__":
    sys.exit(main())
