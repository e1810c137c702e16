"""
vLLM's model runner V2 on this CPU, for the tests: V2 prepares a step's inputs and samples with Triton kernels, which
stock Triton's interpreter (`TRITON_INTERPRET=1`) runs on CPU tensors. vLLM's CPU build counts Triton as present only
when `triton.backends.backends` has a "cpu" entry (`vllm/triton_utils/importing.py`), which stock Triton lacks: an
entry whose driver only says it is active stands in for it (the interpreter never asks it for anything else). Call
before vLLM is imported, in every process that imports it.
"""

import os


# V2's JIT warm-up runs the top-k / top-p kernel, which the interpreter cannot run: the engines start without it (top-k
# and top-p sampling stay unavailable on this path; greedy, min_p, penalties and logprobs run).
V2_ENGINE_ARGS = {"kernel_config": {"enable_jit_warmup": False}}


def run_v2_kernels_on_cpu() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class InterpreterDriver(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return True

    backends.setdefault("cpu", Backend(compiler=BaseBackend, driver=InterpreterDriver))
