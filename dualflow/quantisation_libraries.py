"""
bitsandbytes and torchao around the `dualflow` commands. Both load as soon as they are installed: PEFT imports
bitsandbytes unconditionally and transformers' torchao quantizer imports torchao at import time. And both speak when
they load: bitsandbytes, on a CPU with AVX512-BF16, fetches its 4-bit CPU kernel from the Hub and logs when it cannot;
torchao logs that its CUDA kernels do not load, and torch warns about its Enum registrations. A command that quantises
nothing leaves them out, so that what it prints (a one-line refusal included) is its own.

bitsandbytes' AVX512-BF16 path also has a shape rule the other CPUs do not: outside training, each 4-bit layer's
weight is repacked for its CPU kernel, which takes out_features in multiples of 32 and in_features in whole
quantisation blocks (`cpu_unpackable_4bit_layers`).
"""

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import DualFlowUserError


QUANTISATION_LIBRARIES = ("bitsandbytes", "torchao")
# bitsandbytes' CPU repacking (`bitsandbytes.functional._convert_weight_packed_for_cpu`) packs rows in blocks of 32.
CPU_PACKING_ROWS = 32
# Where bitsandbytes (and the `kernels` package it fetches with) report its CPU kernel fetch.
KERNEL_FETCH_LOGGERS = ("bitsandbytes", "kernels")


@contextmanager
def quantisation_libraries_left_out(keep: tuple[str, ...] = ()) -> Iterator[None]:
    """
    In the block, the quantisation libraries not in `keep` that are not imported yet look uninstalled: importing them
    raises ImportError and `importlib.util.find_spec` finds nothing, which is how transformers and PEFT check for them.
    After the block they can be imported again (a library that cached "absent" in the block keeps that answer).
    """
    left_out = [name for name in QUANTISATION_LIBRARIES if name not in keep and name not in sys.modules]
    for name in left_out:
        sys.modules[name] = None
    try:
        yield
    finally:
        for name in left_out:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextmanager
def held_back_kernel_fetch_logs() -> Iterator[list[str]]:
    """In the block, what bitsandbytes and `kernels` log (warnings and up) is kept in the list yielded, not printed."""
    records = _Records()
    loggers = [logging.getLogger(name) for name in KERNEL_FETCH_LOGGERS]
    saved = [(logger.propagate, logger.level) for logger in loggers]
    for logger in loggers:
        logger.addHandler(records)
        logger.propagate = False
        logger.setLevel(logging.WARNING)
    try:
        yield records.messages
    finally:
        for logger, (propagate, level) in zip(loggers, saved):
            logger.removeHandler(records)
            logger.propagate, logger.level = propagate, level


def kernel_fetch_note(messages: list[str]) -> str | None:
    """
    One line for the user from what bitsandbytes logged while loading: that it could not fetch its CPU 4-bit kernel
    from the Hub (offline, or no `kernels` package; it then computes with its built-in kernel), or the last thing it
    said; None when it said nothing that matters.
    """
    # Offline, `kernels` loads a kernel it fetched before without checking its publisher again, and says so.
    messages = [message for message in messages if "publisher trust check" not in message]
    if not messages:
        return None
    if any("gemm_4bit_forward" in message for message in messages):
        return (
            "note: bitsandbytes could not fetch its CPU 4-bit kernel from the Hub "
            "(kernels-community/quantization-bitsandbytes; offline, or no `kernels` package): "
            "it computes with its built-in kernel instead"
        )
    return f"note: bitsandbytes: {messages[-1].splitlines()[0]}"


def import_bitsandbytes() -> str | None:
    """Import bitsandbytes with what it logs while loading held back; returns `kernel_fetch_note` of it."""
    with held_back_kernel_fetch_logs() as messages:
        import bitsandbytes  # noqa: F401
    return kernel_fetch_note(messages)


def cpu_unpackable_4bit_layers(model) -> list[str]:
    """
    The names of the model's 4-bit linear layers that bitsandbytes cannot repack for its AVX512-BF16 CPU kernel:
    out_features not a multiple of 32, or in_features not a whole number of quantisation blocks.
    """
    from bitsandbytes.nn import Linear4bit

    unpackable = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear4bit):
            continue
        blocksize = module.weight.quant_state.blocksize
        if module.out_features % CPU_PACKING_ROWS or module.in_features % blocksize:
            unpackable.append(name)
    return unpackable


def check_4bit_model_runs_on_this_cpu(model) -> None:
    """
    Refuse, in one line and before any work, a 4-bit model on a CPU with AVX512-BF16 whose layers bitsandbytes cannot
    repack for that CPU's kernel (it would fail at the first evaluation or generation, after training).
    """
    from bitsandbytes.functional import has_avx512bf16

    if model.device.type != "cpu" or not has_avx512bf16():
        return
    unpackable = cpu_unpackable_4bit_layers(model)
    if unpackable:
        layer = model.get_submodule(unpackable[0])
        raise DualFlowUserError(
            f"bitsandbytes' 4-bit kernel for this CPU (AVX512-BF16) needs out_features in multiples of "
            f"{CPU_PACKING_ROWS} and in_features in multiples of {layer.weight.quant_state.blocksize}; "
            f"{len(unpackable)} layers are not ({unpackable[0]}: {layer.in_features} -> {layer.out_features}): "
            f"load this model without --load-in-4bit"
        )
