"""probes: the peak-memory probe sees what a call allocates; the timer measures the call."""

import mmap
import time

import torch

from dualflow.instruments.probes import peak_memory_bytes, rotated, seconds


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
    assert seconds(lambda: time.sleep(0.05), device=torch.device("cpu")) >= 0.05
    assert seconds(time.sleep, 0.05) >= 0.05
    # the process's CPU time does not count a sleep
    assert seconds(time.sleep, 0.05, clock=time.process_time) < 0.04


def test_rotated_puts_every_item_in_every_slot_once_per_cycle():
    orders = [rotated(["a", "b", "c"], repeat) for repeat in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
