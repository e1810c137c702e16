"""lm-eval's vLLM backend (`lm_eval --model vllm`) scores a local multiple-choice task on an engine with
`aux_at_every_prompt_position`: its loglikelihoods and accuracy equal lm-eval's transformers backend on the same model
(the aux flow's predictions), where a default engine refuses prompt logprobs."""

import json

import lm_eval
import pytest
from lm_eval.models.huggingface import HFLM
from lm_eval.models.vllm_causallms import VLLM
from lm_eval.tasks import TaskManager
from vllm_reference import (
    ENGINE_ARGS,
    LOGPROB_TOLERANCE,
    assert_logprobs_close,
    load_reference,
    random_prompts,
    word_tokenizer,
)


TASK = "dualflow_local_choice"
PREFIX_TOKEN_ID = 1  # "<s>": the word tokenizer has no end-of-text token, lm-eval's default prefix
LOGLIKELIHOOD_TOLERANCE = 3 * LOGPROB_TOLERANCE  # summed over a continuation of up to 3 tokens


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    """A multiple-choice task over local JSON lines: word contexts, three word continuations each."""
    folder = tmp_path_factory.mktemp("lm-eval-task")
    words = [[f"w{token}" for token in prompt] for prompt in random_prompts([12] * 8, seed=7)]
    with open(folder / "data.jsonl", "w") as out:
        for i, doc in enumerate(words):
            choices = [" ".join(doc[8 : 8 + n]) for n in (1, 2, 3)]
            out.write(json.dumps({"context": " ".join(doc[:8]), "choices": choices, "label": i % 3}) + "\n")
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'data.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\n"
        "target_delimiter: ' '\n"
        "metric_list:\n  - metric: acc\n"
    )
    return TaskManager(include_path=str(folder))


def evaluate(lm, task_manager):
    results = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=task_manager, log_samples=True)
    loglikelihoods = [[resp[0][0] for resp in sample["resps"]] for sample in results["samples"][TASK]]
    return results["results"][TASK]["acc,none"], loglikelihoods


def test_vllm_backend_equals_transformers_backend(checkpoint, task_manager):
    hf_acc, hf_loglikelihoods = evaluate(
        HFLM(pretrained=load_reference(checkpoint), tokenizer=word_tokenizer(), prefix_token_id=PREFIX_TOKEN_ID),
        task_manager,
    )
    engine_args = {key: value for key, value in ENGINE_ARGS.items() if key not in ("seed", "dtype")}
    lm = VLLM(
        pretrained=str(checkpoint),
        dtype="float32",
        batch_size=4,
        prefix_token_id=PREFIX_TOKEN_ID,
        hf_overrides={"aux_at_every_prompt_position": True},
        **engine_args,
    )
    try:
        vllm_acc, vllm_loglikelihoods = evaluate(lm, task_manager)
    finally:
        lm.model.llm_engine.engine_core.shutdown()
    assert vllm_acc == hf_acc
    for served, expected in zip(vllm_loglikelihoods, hf_loglikelihoods, strict=True):
        assert_logprobs_close(served, expected, LOGLIKELIHOOD_TOLERANCE)
