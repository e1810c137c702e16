"""probes: the peak-memory probe sees what a call allocates; the timer measures the call."""

import mmap
import time

import torch

from dualflow.instruments.probes import peak_memory_bytes, seconds


def test_peak_memory_increase_sees_an_allocation():
    size = 64 * 2**20

    def allocate():
        # An anonymous mapping: pages no allocator holds already (a torch tensor may reuse free heap pages that are
        # still resident, depending on what ran before in the process). Touch every page so it becomes resident.
        block = mmap.mmap(-1, size)
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
        block.close()

    peak, increase = peak_memory_bytes(allocate, torch.device("cpu"))
    assert increase >= 0.9 * size and peak >= increase
    _, idle_increase = peak_memory_bytes(lambda: None, torch.device("cpu"))
    assert idle_increase < size / 4


def test_seconds_measures_the_call():
    assert seconds(lambda: time.sleep(0.05), torch.device("cpu")) >= 0.05
