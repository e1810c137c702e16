"""`dualflow demo`: the fresh-machine job end to end."""

import torch

from dualflow.cli import main


def test_demo_runs_end_to_end(capsys):
    threads = torch.get_num_threads()
    try:  # --threads and --repeats: what the "too noisy to read" line recommends
        assert main(["demo", "--threads", "1", "--repeats", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    assert "aux on with k_a = k_p reproduces the source model: yes" in captured.out
    assert "two-pass" in captured.out and "KV cache KiB" in captured.out
    assert "medians of 2 repeats (ratio to primary-only, range over repeats), torch threads: 1" in captured.out
    assert "peak memory MiB" not in captured.out  # on CPU the process's peak RSS is the same in every column
    assert "timing" in captured.err  # step 4's progress bars
