"""probes: the peak-memory probe sees what a call allocates; the timer measures the call."""

import time

import torch

from dualflow.instruments.probes import peak_memory_bytes, seconds


def test_peak_memory_increase_sees_an_allocation():
    size = 64 * 2**20

    def allocate():
        block = torch.ones(size // 4)  # 64 MiB of float32, touched so the pages are resident
        return block.sum()

    peak, increase = peak_memory_bytes(allocate, torch.device("cpu"))
    assert increase >= 0.9 * size and peak >= increase
    _, idle_increase = peak_memory_bytes(lambda: None, torch.device("cpu"))
    assert idle_increase < size / 4


def test_seconds_measures_the_call():
    assert seconds(lambda: time.sleep(0.05), torch.device("cpu")) >= 0.05
