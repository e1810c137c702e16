"""The engine configuration fails closed: every field of vLLM's `VllmConfig` (recursively) is classified in
dualflow/serving/engine_allowlist.py, a setting outside the classification is refused in one line naming the field, and
the configurations the other tests run still build. Configurations are built, no engine starts."""

import dataclasses
import json
import typing

import pytest
import torch
import vllm
from packaging.version import Version
from test_vllm_support_matrix import SetOnBuilt, engine_config, raised_by_the_model
from vllm.config import VllmConfig, WeightTransferConfig
from vllm_reference import ADAPTER_RANK, PREFIX_CACHING_AND_CHUNKED_PREFILL, start_engine

from dualflow.serving import engine_allowlist
from dualflow.serving.engine_allowlist import ENGINE_FIELDS, FIELDS_ADDED_IN_VLLM_0_34, classification
from dualflow.serving.engine_config import check_supported


def config_dataclasses(annotation) -> list[type]:
    """The vLLM config dataclasses a field's annotation names (`X | None`, `Optional[X]`, ...)."""
    candidates = [annotation, *typing.get_args(annotation)]
    return [c for c in candidates if isinstance(c, type) and dataclasses.is_dataclass(c)]


def engine_field_paths(config_class: type = VllmConfig, prefix: str = "") -> list[str]:
    """Every field's dotted path (a sub-config's too when it is classified as a whole), and its sub-configs' fields."""
    paths = []
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        path = prefix + field.name
        sub_configs = config_dataclasses(hints[field.name])
        if path in ENGINE_FIELDS or not sub_configs:
            paths.append(path)
        for sub_config in sub_configs:
            paths += engine_field_paths(sub_config, path + ".")
    return paths


def test_every_field_of_vllms_engine_config_is_classified():
    # A vLLM release that adds a field fails here until someone decides what it is (engine_allowlist.py).
    unclassified = [path for path in engine_field_paths() if classification(path) is None]
    assert unclassified == []


def test_every_classified_field_exists_in_vllm():
    # An entry vLLM no longer has would let a renamed field pass unnoticed; a later release's fields are not there yet.
    later = set(FIELDS_ADDED_IN_VLLM_0_34) if Version(vllm.__version__) < Version("0.34") else set()
    assert set(ENGINE_FIELDS) - set(engine_field_paths()) - later == set()
    assert later.isdisjoint(engine_field_paths())


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
EXAMPLE_CONNECTOR = {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": "/tmp"}}

# The configurations tests/vllm runs (vllm_reference.ENGINE_ARGS under each): they must keep building.
TESTED_CONFIGURATIONS = {
    "defaults": {},
    "prefix caching and chunked prefill": PREFIX_CACHING_AND_CHUNKED_PREFILL,
    "no prefix caching": {"enable_prefix_caching": False},
    "tensor parallelism": {"tensor_parallel_size": 2},
    "n-gram speculation": {"speculative_config": NGRAM},
    "Inductor": {"compilation_config": {"mode": "DYNAMO_TRACE_ONCE", "backend": "inductor"}},
    "eager": {"enforce_eager": True},
    "piecewise graphs": {
        "compilation_config": {
            "mode": "VLLM_COMPILE",
            "backend": "eager",
            "cudagraph_mode": "PIECEWISE",
            "cudagraph_capture_sizes": [1, 2, 4, 8],
            "pass_config": {"fuse_norm_quant": False, "fuse_act_quant": False},
        }
    },
    "bfloat16": {"dtype": "bfloat16"},
    "P/D producer": {"kv_transfer_config": {**EXAMPLE_CONNECTOR, "kv_role": "kv_producer"}},
    "P/D consumer": {
        "kv_transfer_config": {**EXAMPLE_CONNECTOR, "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}
    },
    "P/D consumer over NIXL": {
        "kv_transfer_config": {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_consumer",
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"producer_model": "Qwen/Qwen3-30B-A3B"},
        }
    },
    "primary flow only": {"hf_overrides": {"use_aux_flow": False}},
    "aux top-k and every prompt position": {
        "hf_overrides": {"aux_num_experts_per_tok": 3, "aux_at_every_prompt_position": True},
        "max_model_len": 128,
        "seed": 7,
        "block_size": 16,
    },
}


@pytest.mark.parametrize("engine_args", TESTED_CONFIGURATIONS.values(), ids=TESTED_CONFIGURATIONS)
def test_the_tested_configurations_build(checkpoint, engine_args):
    built = engine_config(checkpoint, **engine_args)
    check_supported(built.model_config.hf_config, built)  # the built configuration too (vLLM filled the rest)


def test_what_vllms_cpu_platform_sets_on_avx512_bf16_cpus_is_accepted(checkpoint, monkeypatch):
    # vLLM's CPU platform asks torch for the CPU's AVX512-BF16 support (this CPU's own answer decides which path it
    # takes): on such CPUs it stores mamba states in float32, for models without mamba layers too.
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    built = engine_config(checkpoint)
    assert built.cache_config.mamba_ssm_cache_dtype == "float32"
    check_supported(built.model_config.hf_config, built)


def test_a_checkpoint_with_rounds_and_adapters_builds(adapter_checkpoint):
    engine_config(adapter_checkpoint, hf_overrides={"aux_num_rounds": 2, "aux_adapter_rank": ADAPTER_RANK})


def test_a_quantised_checkpoint_builds(quantised_checkpoint):
    built = engine_config(quantised_checkpoint)
    assert built.model_config.quantization == "compressed-tensors"
    check_supported(built.model_config.hf_config, built)


# A quantization_config other than `dualflow quantize`'s: a change to it -> the field and value refused.
OTHER_QUANTISATIONS = {
    "quantised experts": (
        lambda q: q["ignore"].remove(r"re:.*\.mlp\.experts.*"),
        "quantization_config.ignore=['lm_head', 're:.*embed_tokens$', ",
    ),
    "int8 weights": (
        lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8),
        "quantization_config.config_groups.group_0.weights.num_bits=8 (the checkpoint's)",
    ),
    "every linear layer (llm-compressor's targets)": (
        lambda q: q["config_groups"]["group_0"].update(targets=["Linear"]),
        "quantization_config.config_groups.group_0.targets=['Linear'] (the checkpoint's)",
    ),
}


@pytest.mark.parametrize(("change", "message"), OTHER_QUANTISATIONS.values(), ids=OTHER_QUANTISATIONS)
def test_any_other_quantisation_is_refused_in_one_line(quantised_checkpoint, tmp_path, change, message):
    for entry in quantised_checkpoint.iterdir():  # the same checkpoint with another config.json
        if entry.name != "config.json":
            (tmp_path / entry.name).symlink_to(entry)
    config = json.loads((quantised_checkpoint / "config.json").read_text())
    change(config["quantization_config"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as refused:
        engine_config(tmp_path)
    error = str(raised_by_the_model(refused.value))
    assert error.startswith("Dual-Flow in vLLM does not serve ") and "\n" not in error
    assert message in error and error.endswith("write it with `dualflow quantize`"), error


# Settings outside the classification, and the explicit refusals of issue 55: (engine options, or an option set on a
# built configuration where vLLM's CPU build refuses it first) -> the start of the one-line refusal.
REFUSED = {
    "CPU weight offload": ({"cpu_offload_gb": 1}, "offload_config.uva.cpu_offload_gb=1.0 (vLLM's default: 0)"),
    "prefetch offload": (
        {"offload_group_size": 2, "offload_num_in_group": 1},
        "offload_config.prefetch.offload_group_size=2 (vLLM's default: 0)",
    ),
    "routed-experts capture": (
        SetOnBuilt("aux_output_config", "enable_return_routed_experts", True),
        "aux_output_config.enable_return_routed_experts=True (vLLM's default: False): vLLM's routed-experts capturer",
    ),
    "pooling runner": ({"runner": "pooling"}, "model_config.runner='pooling': the pooling runner would return"),
    "pooling adapter": ({"convert": "embed"}, "model_config.convert='embed': the pooling runner would return"),
    "GPU n-gram speculation": (
        {"speculative_config": {**NGRAM, "method": "ngram_gpu"}},
        "speculative_config.method='ngram_gpu': only n-gram speculation has run",
    ),
    "quantisation": (
        {"quantization": "fp8", "dtype": "bfloat16"},
        "model_config.quantization='fp8': the quantised checkpoints served are compressed-tensors W4A8 on",
    ),
    "dummy weights": ({"load_format": "dummy"}, "load_config.load_format='dummy' (vLLM's default: 'auto')"),
    "another model implementation": (
        SetOnBuilt("model_config", "model_impl", "transformers"),
        "model_config.model_impl='transformers' (vLLM's default: 'auto'): it would serve another implementation",
    ),
    "untested tensor-parallel size": (
        {"tensor_parallel_size": 4},
        r"parallel_config.tensor_parallel_size=4: use one of 1, 2",
    ),
    "float16": ({"dtype": "float16"}, "model_config.dtype=torch.float16: use one of"),
    "optimisation level": ({"optimization_level": 3}, "optimization_level=<OptimizationLevel.O3: 3>"),
    "hf_overrides of a checkpoint field": (
        {"hf_overrides": {"num_experts_per_tok": 4}},
        "hf_overrides of num_experts_per_tok: the overrides run with this model are",
    ),
    "the ExampleConnector under tensor parallelism": (
        {"tensor_parallel_size": 2, "kv_transfer_config": {**EXAMPLE_CONNECTOR, "kv_role": "kv_producer"}},
        "does not run the ExampleConnector with tensor_parallel_size=2 (its files carry no rank",
    ),
}


def refusal_of(checkpoint, case, monkeypatch) -> str:
    with pytest.raises(ValueError) as refused:
        if isinstance(case, SetOnBuilt):
            built = engine_config(checkpoint)
            monkeypatch.setattr(getattr(built, case.section), case.field, case.value)
            check_supported(built.model_config.hf_config, built)
        else:
            engine_config(checkpoint, **case)
    return str(raised_by_the_model(refused.value))


@pytest.mark.parametrize(("case", "message"), REFUSED.values(), ids=REFUSED)
def test_a_setting_outside_the_classification_is_refused_in_one_line(checkpoint, case, message, monkeypatch):
    error = refusal_of(checkpoint, case, monkeypatch)
    assert error.startswith("Dual-Flow in vLLM does ") and "\n" not in error
    assert message in error, error


@pytest.mark.parametrize("method", ["draft_model", "suffix", "eagle", "mtp", "custom_class"])
def test_speculative_methods_other_than_ngram_are_refused(checkpoint, method, monkeypatch):
    # vLLM checks the draft model (or Arctic Inference) before the model's hook: set on a built n-gram configuration
    built = engine_config(checkpoint, speculative_config=NGRAM)
    monkeypatch.setattr(built.speculative_config, "method", method)
    with pytest.raises(ValueError, match=rf"^Dual-Flow in vLLM does not serve speculative_config.method='{method}'"):
        check_supported(built.model_config.hf_config, built)


def test_an_unclassified_field_is_refused_when_set(checkpoint, monkeypatch):
    # What a vLLM upgrade's new field meets before the classification test is updated: refused, not accepted.
    monkeypatch.delitem(ENGINE_FIELDS, "cache_config.kv_cache_memory_bytes")
    error = refusal_of(checkpoint, {"kv_cache_memory_bytes": 2**26}, monkeypatch)
    assert error == (
        "Dual-Flow in vLLM does not serve cache_config.kv_cache_memory_bytes=67108864 (vLLM's default: None): "
        "this vLLM field is not classified for Dual-Flow (dualflow/serving/engine_allowlist.py): start without it"
    )
    monkeypatch.undo()
    assert engine_allowlist.refusal(engine_config(checkpoint, kv_cache_memory_bytes=2**26)) is None  # inert


def test_a_sub_config_vllm_leaves_unset_is_refused_when_set(checkpoint, monkeypatch):
    # At its own defaults it still asks for a feature (here weight updates while serving).
    built = engine_config(checkpoint)
    monkeypatch.setattr(built, "weight_transfer_config", WeightTransferConfig())
    with pytest.raises(ValueError) as refused:
        check_supported(built.model_config.hf_config, built)
    assert str(refused.value) == (
        "Dual-Flow in vLLM does not serve weight_transfer_config (set; vLLM's default: None): "
        "weight updates while serving have never run with this model: start without weight_transfer_config"
    )


def test_a_served_engines_configuration_passes(engines, checkpoint):
    # vLLM fills more fields once the engine has started (the KV cache layout, the compiled layers): derived ones
    vllm_config = engines.get(checkpoint, **PREFIX_CACHING_AND_CHUNKED_PREFILL).llm_engine.vllm_config
    assert engine_allowlist.refusal(vllm_config) is None


def test_what_vllm_settles_after_the_hook_is_checked_when_the_model_is_built(checkpoint, engines, monkeypatch):
    # On a GPU vLLM resolves asynchronous scheduling to True after the model's hook has checked the configuration;
    # here the CPU platform's settling sets it, as a GPU's would, on the V1 runner, where it has never run.
    from vllm.platforms.cpu import CpuPlatform

    settle = CpuPlatform.check_and_update_config.__func__

    def settle_as_a_gpu(cls, vllm_config):
        settle(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(settle_as_a_gpu))
    engines.close()  # one CPU engine in this process at a time (conftest.py)
    with pytest.raises(ValueError) as refused:
        start_engine(checkpoint)
    assert str(refused.value) == (
        "Dual-Flow in vLLM schedules asynchronously on vLLM's model runner V2 only (tested there): start with "
        "--no-async-scheduling (async_scheduling=False) or on V2"
    )
