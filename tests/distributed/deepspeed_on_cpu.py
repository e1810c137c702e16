"""
Test-side shim: let accelerate run DeepSpeed on a CPU, with gloo between the processes of torchrun.

accelerate starts DeepSpeed only on an accelerator. On a CPU-only machine, `TrainingArguments(deepspeed=...)` under
torchrun then counts one process of one on every rank while torch.distributed has them all (each rank believes it
is the main one: every rank writes the final save, none gets its own share of the data, "auto" batch sizes are
filled for one rank). accelerate picks the distributed backend of the device type `get_torch_accelerator_backend`
names, from `TORCH_DISTRIBUTED_BACKENDS`: naming the CPU with gloo there gives DeepSpeed (its CPU accelerator, which
speaks gloo where oneccl_bindings_for_pytorch is absent) the true ranks and world size. On GPUs none of this is
needed; the package itself does not do it.
"""

import accelerate.state
from accelerate.utils import constants


def treat_cpu_as_accelerator() -> None:
    """Call before the first `TrainingArguments` (which sets accelerate's distributed state up)."""
    constants.TORCH_DISTRIBUTED_BACKENDS["cpu"] = "gloo"  # the dict accelerate.utils.imports reads
    accelerate.state.get_torch_accelerator_backend = lambda check_available=True: ("cpu", None)
