"""`dualflow demo`: the fresh-machine job end to end."""

from dualflow.cli import main


def test_demo_runs_end_to_end(capsys):
    assert main(["demo"]) == 0
    captured = capsys.readouterr()
    assert "aux on with k_a = k_p reproduces the source model: yes" in captured.out
    assert "two-pass" in captured.out and "KV cache KiB" in captured.out
    assert "range over repeats" in captured.out
    assert "timing" in captured.err  # step 4's progress bars
