"""The support matrix in docs/serving.md held against the engine configuration: every engine option it calls refused is
refused in one line while vLLM builds the configuration (no engine starts), and every compilation pass it calls turned
off is off in the built configuration, even where vLLM's defaults would switch it on. The matrix is read from the
document, so a row cannot be marked refused or turned off without a case here."""

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import ValidationError
from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG
from vllm.engine.arg_utils import EngineArgs
from vllm_reference import ENGINE_ARGS

from dualflow.serving.engine_config import TOKEN_SIZED_PASSES, check_supported


SERVING_DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
STATUSES = {"tested on CPU", "simulated", "refused", "turned off", "never run"}


@dataclass(frozen=True)
class SetOnBuilt:
    """An option vLLM's CPU build refuses itself before the model's hook runs: set on a built configuration instead,
    then the model's check is called on it."""

    section: str
    field: str
    value: object


KV_CONNECTOR = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
}
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
    "KV connectors other than the ExampleConnector (NIXL, LMCache, Mooncake, offloading)": [
        (
            {"kv_transfer_config": KV_CONNECTOR},
            r"runs the KV connector ExampleConnector only \(tested\), not 'NixlConnector'",
        )
    ],
    "Quantised KV cache (fp8, fp8_e4m3, fp8_e5m2)": [
        (
            {"kv_cache_dtype": dtype},
            rf"quantised KV cache \(kv_cache_dtype='{dtype}'; .*start with kv_cache_dtype='auto'",
        )
        for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2")
    ],
    "Full CUDA graphs for steps that mix prefill and decode, with the aux flow": [
        ({"compilation_config": {"cudagraph_mode": "FULL"}}, r"full CUDA graphs \(cudagraph_mode=FULL\): use")
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


def test_the_matrix_has_a_case_for_every_refused_row_and_only_known_statuses():
    rows = support_matrix()
    assert {status for _, status in rows.values()} <= STATUSES
    assert {feature for feature, (_, status) in rows.items() if status == "refused"} == set(REFUSED)
    assert turned_off_passes() == list(TOKEN_SIZED_PASSES)


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
