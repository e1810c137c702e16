"""
The timer and the peak-memory probe of one call, on CPU (Linux /proc, else getrusage) or CUDA, the order of
interleaved repeats, and the bytes a model's weights take. Every measurement of the package times with these.
"""

import gc
import os
import resource
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def seconds(fn, *args, device: torch.device | None = None, clock=time.perf_counter) -> float:
    """
    Seconds `fn(*args)` takes by `clock` (the wall clock; `time.process_time` for the process's CPU time). On a CUDA
    `device` the kernels queued before and by the call are waited for.
    """
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = clock()
    fn(*args)
    if cuda:
        torch.cuda.synchronize(device)
    return clock() - start


def rotated(items: list, repeat: int) -> list:
    """
    The order of repeat number `repeat` of an interleaved measurement: A B C, then B C A, then C A B, ... Every item
    runs in every slot equally often and after a different neighbour, so machine noise and warm caches favour none.
    """
    shift = repeat % len(items)
    return items[shift:] + items[:shift]


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated() (all tensors, weights included)"
    if _status_kib("VmHWM") is not None and os.access("/proc/self/clear_refs", os.W_OK):
        return "process peak RSS (Linux VmHWM, reset via /proc/self/clear_refs before the call)"
    return "process lifetime peak RSS (getrusage ru_maxrss; cannot be reset, so an older peak can hide this one)"


def peak_memory_bytes(fn, device: torch.device) -> tuple[int, int]:
    """(peak memory during `fn()`, that peak minus the memory in use before it); see `peak_memory_method`."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return peak, peak - before
    if "VmHWM" in peak_memory_method(device):
        Path("/proc/self/clear_refs").write_text("5")  # 5 = reset the peak RSS to the current RSS
        before = _status_kib("VmRSS")
        fn()
        peak = _status_kib("VmHWM")
        return peak * 1024, (peak - before) * 1024
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * scale, (peak - before) * scale


def stored_bytes(model) -> int:
    """Bytes the weights and buffers take in memory: a quantised tensor (torchao's) by its inner data and scales."""

    def size(tensor):
        if not is_traceable_wrapper_subclass(tensor):
            return tensor.nelement() * tensor.element_size()
        inner_names, _ = tensor.__tensor_flatten__()
        return sum(size(getattr(tensor, name)) for name in inner_names)

    return sum(size(tensor) for tensor in [*model.parameters(), *model.buffers()])
