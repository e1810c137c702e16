"""
On vLLM's model runner V2 only (collected when VLLM_USE_V2_MODEL_RUNNER=1, conftest.py): asynchronous scheduling, the
GPU default that vLLM's CPU platform switches off, serves transformers' tokens with the aux flow on. The rest of what
V2 runs (armed fast prefill in mixed steps, pure decode, chunked prefill, prefix caching, n-gram speculation, rounds
and adapters) is the other modules' tests, run again on V2 by CI.
"""

import pytest
from vllm.platforms.cpu import CpuPlatform
from vllm_reference import (
    PREFIX_CACHING_AND_CHUNKED_PREFILL,
    assert_matches_transformers,
    load_reference,
    random_prompts,
    running_engine,
    served_greedy,
)


MAX_NEW = 8
PROMPTS = random_prompts([3, 17, 40, 29], seed=3)


@pytest.fixture
def async_scheduling_kept(monkeypatch):
    """vLLM's CPU platform turns asynchronous scheduling off after the model's hook; keep what the engine asked for."""
    settle = CpuPlatform.check_and_update_config.__func__

    def settle_keeping_async(cls, vllm_config):
        asked = vllm_config.scheduler_config.async_scheduling
        settle(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = asked

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(settle_keeping_async))


def test_async_scheduling_serves_transformers_tokens(checkpoint, engines, async_scheduling_kept):
    engines.close()  # one CPU engine in this process at a time (conftest.py)
    with running_engine(checkpoint, async_scheduling=True, **PREFIX_CACHING_AND_CHUNKED_PREFILL) as engine:
        config = engine.llm_engine.vllm_config
        assert config.use_v2_model_runner and config.scheduler_config.async_scheduling
        outputs = served_greedy(engine, PROMPTS, MAX_NEW)
    assert_matches_transformers(outputs, PROMPTS, load_reference(checkpoint), MAX_NEW)
