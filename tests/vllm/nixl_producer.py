"""
The NixlConnector's producer for test_vllm_kv_transfer.py, in a process of its own (vLLM's KV connector is one per
process, and the consumer runs in the test's): a vLLM engine on the model given, as `kv_producer`. Each line on stdin
is a JSON list of token-id prompts; it prefills them (one token each, `do_remote_decode`, as vLLM's disaggregation
proxy asks a producer) and answers with one line, PARAMS_LINE and the prompts' `kv_transfer_params` as JSON: what the
proxy passes on to the consumer. The prompts' KV stays for the consumer to read until stdin closes.

    VLLM_NIXL_SIDE_CHANNEL_PORT=PORT python nixl_producer.py MODEL TOKENIZER
"""

import faulthandler
import json
import signal
import sys

from vllm import LLM, SamplingParams
from vllm_reference import ENGINE_ARGS


PARAMS_LINE = "kv_transfer_params: "  # vLLM logs to stdout too
NIXL_PRODUCER = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}


def main(model: str, tokenizer: str) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test asks for the stacks of a producer that does not answer
    llm = LLM(model=model, tokenizer=tokenizer, kv_transfer_config=NIXL_PRODUCER, **ENGINE_ARGS)
    remote_decode = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    for line in sys.stdin:
        prompts = [{"prompt_token_ids": prompt} for prompt in json.loads(line)]
        outputs = llm.generate(prompts, remote_decode, use_tqdm=False)
        print(PARAMS_LINE + json.dumps([output.kv_transfer_params for output in outputs]), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
