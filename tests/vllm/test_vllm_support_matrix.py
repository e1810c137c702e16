"""The support matrix in docs/serving.md held against the engine configuration and its allowlist
(dualflow/serving/engine_allowlist.py): every field a row names is classified as the row's status says, every tested
field is named in a row, every feature the matrix calls refused is refused in one line while vLLM builds the
configuration (no engine starts), and every compilation pass it calls turned off is off in the built configuration,
even where vLLM's defaults would switch it on. The matrix is read from the document, so a row cannot be marked refused
or turned off without a case here."""

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import ValidationError
from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG
from vllm.engine.arg_utils import EngineArgs
from vllm_reference import ENGINE_ARGS

from dualflow.serving.engine_allowlist import ENGINE_FIELDS, Derived, Tested
from dualflow.serving.engine_config import TOKEN_SIZED_PASSES, check_supported


SERVING_DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
# What the allowlist classifies a field a row names as, by the row's status; refused rows may name any classified field
# (a value of it, or a combination, is refused).
STATUS_CLASSES = {
    "tested on CPU": Tested,
    "simulated": Tested,
    "turned off": Tested,
    "derived": Derived,
    "refused": object,
}


@dataclass(frozen=True)
class SetOnBuilt:
    """An option vLLM's CPU build refuses itself before the model's hook runs: set on a built configuration instead,
    then the model's check is called on it."""

    section: str
    field: str
    value: object


NIXL_CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
EXPERT_PARALLEL_REFUSAL = r"not been verified with expert parallelism \(enable_expert_parallel, all2all_backend='{}'\)"
CONTEXT_PARALLEL_REFUSAL = "not been verified with context parallelism: start with prefill_context_parallel_size=1"

# The matrix's refused rows (feature column, verbatim): the options that ask for the feature, and the refusal each
# must meet.
REFUSED = {
    'Tensor parallelism with `qk_norm="full"` (OLMoE)': [
        ({"tensor_parallel_size": 2, "hf_overrides": {"qk_norm": "full"}}, r"qk_norm='full' \(OLMoE\) needs the whole")
    ],
    "Pipeline parallelism": [({"pipeline_parallel_size": 2}, "does not support pipeline parallelism")],
    "Data parallelism": [({"data_parallel_size": 2}, r"does not support data parallelism \(data_parallel_size=2\)")],
    "Expert parallelism, every `all2all_backend`": [
        ({"enable_expert_parallel": True, "all2all_backend": backend}, EXPERT_PARALLEL_REFUSAL.format(backend))
        for backend in ("allgather_reducescatter", "deepep_low_latency")
    ],
    "Expert-parallel load balancer (EPLB)": [
        (SetOnBuilt("parallel_config", "enable_eplb", True), "expert-parallel load balancer: start without enable_eplb")
    ],
    "Context parallelism, prefill or decode": [
        (SetOnBuilt("parallel_config", "prefill_context_parallel_size", 2), CONTEXT_PARALLEL_REFUSAL),
        ({"tensor_parallel_size": 2, "decode_context_parallel_size": 2}, CONTEXT_PARALLEL_REFUSAL),
    ],
    "Dual-batch overlap (DBO)": [({"enable_dbo": True}, "does not run dual-batch overlap")],
    "LoRA adapters": [({"enable_lora": True}, "does not serve LoRA adapters: start without enable_lora")],
    "Prompt embeddings with the aux flow": [
        ({"enable_prompt_embeds": True}, r"prompt embeddings \(enable_prompt_embeds\) need use_aux_flow=False")
    ],
    "KV connectors other than the ExampleConnector and the NixlConnector (LMCache, Mooncake, offloading)": [
        (
            {"kv_transfer_config": {"kv_connector": name, "kv_role": "kv_both"}},
            rf"runs the KV connector ExampleConnector or NixlConnector only \(tested\), not '{name}'",
        )
        for name in ("LMCacheConnectorV1", "MooncakeConnector", "OffloadingConnector", "SimpleCPUOffloadConnector")
    ],
    "The NixlConnector on a Dual-Flow producer": [
        (
            {"kv_transfer_config": {**NIXL_CONSUMER, "kv_role": role}},
            rf"runs the NixlConnector as kv_consumer only \(tested\), not as '{role}'",
        )
        for role in ("kv_producer", "kv_both")
    ],
    "The NixlConnector with tensor parallelism": [
        (
            {"tensor_parallel_size": 2, "kv_transfer_config": NIXL_CONSUMER},
            r"does not run the NixlConnector with tensor_parallel_size=2 \(never run with this model\)",
        )
    ],
    "Quantised KV cache (fp8, fp8_e4m3, fp8_e5m2)": [
        (
            {"kv_cache_dtype": dtype},
            rf"quantised KV cache \(kv_cache_dtype='{dtype}'; .*start with kv_cache_dtype='auto'",
        )
        for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2")
    ],
    "Full CUDA graphs for steps that mix prefill and decode": [
        ({"compilation_config": {"cudagraph_mode": "FULL"}}, r"full CUDA graphs \(cudagraph_mode=FULL\): use"),
        (
            {"compilation_config": {"cudagraph_mode": "FULL"}, "hf_overrides": {"use_aux_flow": False}},
            r"compilation_config.cudagraph_mode=<CUDAGraphMode.FULL: 2>: use one of",
        ),
    ],
    'The pooling runner, pooling adapters (`runner="pooling"`, `convert="embed"`, ...)': [
        ({"runner": "pooling"}, "model_config.runner='pooling': the pooling runner would return the aux flow's"),
        ({"convert": "embed"}, "model_config.convert='embed': the pooling runner would return the aux flow's"),
    ],
    "Tensor parallelism above 2": [
        ({"tensor_parallel_size": 4}, r"parallel_config.tensor_parallel_size=4: use one of 1, 2")
    ],
    "Prompt embeddings with `use_aux_flow: false`": [
        (
            {"enable_prompt_embeds": True, "hf_overrides": {"use_aux_flow": False}},
            r"model_config.enable_prompt_embeds=True \(vLLM's default: False\): prompt embeddings have never run",
        )
    ],
    "Routed-experts capture": [
        (
            SetOnBuilt("aux_output_config", "enable_return_routed_experts", True),
            "aux_output_config.enable_return_routed_experts=True .*: vLLM's routed-experts capturer asserts",
        )
    ],
    "The ExampleConnector with tensor parallelism": [
        (
            {
                "tensor_parallel_size": 2,
                "kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_producer"},
            },
            r"does not run the ExampleConnector with tensor_parallel_size=2 \(its files carry no rank",
        )
    ],
    "KV cache offloading": [
        (SetOnBuilt("cache_config", "kv_offloading_size", 4.0), r"cache_config.kv_offloading_size=4.0 \(vLLM's default")
    ],
    "CPU weight offload (UVA or prefetch)": [
        ({"cpu_offload_gb": 1}, r"offload_config.uva.cpu_offload_gb=1.0 .*CPU weight offload has never run"),
        (
            {"offload_group_size": 2, "offload_num_in_group": 1},
            r"offload_config.prefetch.offload_group_size=2 .*CPU weight offload has never run",
        ),
    ],
    "Other quantisation: online (fp8), other formats and schemes (FP8, INT8, AWQ, GPTQ), quantised experts": [
        (
            {"quantization": "fp8", "dtype": "bfloat16"},
            r"model_config.quantization='fp8': the quantised checkpoints served are compressed-tensors W4A8",
        )
    ],
    "Speculative decoding other than n-gram (`ngram_gpu`, `draft_model`, EAGLE, MTP, `suffix`, `custom_class`, ...)": [
        (
            {"speculative_config": {"method": "ngram_gpu", "num_speculative_tokens": 2}},
            "speculative_config.method='ngram_gpu': only n-gram speculation has run with this model",
        )
    ],
    "Any other field of vLLM's engine configuration away from vLLM's default (`optimization_level`, "
    "`attention_config`, `kernel_config.moe_backend`, sleep mode, multi-node, ...)": [
        ({"optimization_level": 3}, r"optimization_level=<OptimizationLevel.O3: 3> \(vLLM's default"),
        (
            SetOnBuilt("model_config", "enable_sleep_mode", True),
            r"model_config.enable_sleep_mode=True \(vLLM's default: False\)",
        ),
    ],
    "Asynchronous scheduling on the V1 runner": [
        (
            SetOnBuilt("scheduler_config", "async_scheduling", True),
            "schedules asynchronously on vLLM's model runner V2 only",
        )
    ],
}


def support_matrix() -> dict[str, tuple[str, str]]:
    """The rows of docs/serving.md's support matrix: feature -> (engine option, status)."""
    section = SERVING_DOC.read_text().split("\n## Support matrix\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| "):
            continue
        feature, option, status, _ = (cell.strip() for cell in line.strip().strip("|").split("|"))
        if feature not in ("feature", "---"):  # the header and the separator row
            rows[feature] = (option, status)
    return rows


def turned_off_passes() -> list[str]:
    """The compilation passes the matrix calls turned off, by their `PassConfig` field."""
    passes = []
    for option, status in support_matrix().values():
        if status == "turned off":
            passes.append(re.fullmatch(r"`compilation_config\.pass_config\.(\w+)`", option).group(1))
    return passes


def engine_config(checkpoint, **engine_args):
    """The configuration vLLM builds for an engine on the checkpoint (the model's config hook included), without
    starting the engine."""
    return EngineArgs(model=str(checkpoint), **{**ENGINE_ARGS, **engine_args}).create_engine_config()


def raised_by_the_model(error: ValueError) -> ValueError:
    """vLLM's configuration is a pydantic dataclass: what its post-init (the model's hook) raises comes wrapped."""
    if isinstance(error, ValidationError):
        (inner,) = [detail["ctx"]["error"] for detail in error.errors()]
        return inner
    return error


@pytest.fixture(scope="module")
def built(checkpoint):
    return engine_config(checkpoint)


def named_fields(option: str) -> list[str]:
    """The allowlist entries an engine-fields cell names (environment variables, `VLLM_...`, are not fields)."""
    return [name for name in re.findall(r"`([^`]+)`", option) if not name.startswith("VLLM_")]


def test_the_matrix_has_a_case_for_every_refused_row_and_only_known_statuses():
    rows = support_matrix()
    assert {status for _, status in rows.values()} <= set(STATUS_CLASSES)
    assert {feature for feature, (_, status) in rows.items() if status == "refused"} == set(REFUSED)
    assert turned_off_passes() == list(TOKEN_SIZED_PASSES)


def test_the_matrix_and_the_allowlist_agree_both_ways():
    rows = support_matrix().values()
    for option, status in rows:
        for name in named_fields(option):
            assert name in ENGINE_FIELDS, name
            assert isinstance(ENGINE_FIELDS[name], STATUS_CLASSES[status]), (name, status, ENGINE_FIELDS[name])
    # Every value accepted because it ran is in a row that says where it ran.
    shown_as_run = {
        name for option, status in rows if STATUS_CLASSES[status] is Tested for name in named_fields(option)
    }
    assert {name for name, rule in ENGINE_FIELDS.items() if isinstance(rule, Tested)} - shown_as_run == set()


@pytest.mark.parametrize(
    ("case", "message"),
    [case for cases in REFUSED.values() for case in cases],
    ids=[f"{feature}-{i}" for feature, cases in REFUSED.items() for i in range(len(cases))],
)
def test_each_refused_option_is_refused_in_one_line(case, message, checkpoint, built, monkeypatch):
    with pytest.raises(ValueError) as refused:
        if isinstance(case, SetOnBuilt):
            monkeypatch.setattr(getattr(built, case.section), case.field, case.value)
            check_supported(built.model_config.hf_config, built)
        else:
            engine_config(checkpoint, **case)
    error = str(raised_by_the_model(refused.value))
    assert error.startswith("Dual-Flow in vLLM") and "\n" not in error
    assert re.search(message, error), error


def test_turned_off_passes_stay_off_where_vllms_defaults_switch_them_on(checkpoint, built, monkeypatch):
    passes = turned_off_passes()
    assert {name: getattr(built.compilation_config.pass_config, name) for name in passes} == dict.fromkeys(
        passes, False
    )
    # A GPU's defaults (TP > 1 on Hopper, ROCm with AITER) switch them on: vLLM fills them in after the model's hook.
    defaults = OPTIMIZATION_LEVEL_TO_CONFIG[built.optimization_level]["compilation_config"]["pass_config"]
    for name in passes:
        monkeypatch.setitem(defaults, name, True)
    aux = engine_config(checkpoint).compilation_config.pass_config
    primary_only = engine_config(checkpoint, hf_overrides={"use_aux_flow": False}).compilation_config.pass_config
    assert {name: getattr(aux, name) for name in passes} == dict.fromkeys(passes, False)
    assert primary_only.fuse_allreduce_rms is True  # the base model's rows: vLLM's choice is kept


@pytest.mark.parametrize("name", turned_off_passes())
def test_a_turned_off_pass_switched_on_is_refused_in_one_line(name, built, monkeypatch):
    # vLLM's CPU build switches the ROCm passes off itself when they are asked for: set on a built configuration
    monkeypatch.setattr(built.compilation_config.pass_config, name, True)
    with pytest.raises(ValueError, match=rf"cannot run the compilation pass {name} \(it sizes by") as refused:
        check_supported(built.model_config.hf_config, built)
    assert "\n" not in str(refused.value)


def test_a_pass_the_user_switches_on_reaches_the_check_before_vllms_defaults(checkpoint):
    with pytest.raises(ValueError) as refused:
        engine_config(checkpoint, compilation_config={"pass_config": {"fuse_allreduce_rms": True}})
    assert "cannot run the compilation pass fuse_allreduce_rms" in str(raised_by_the_model(refused.value))
