"""benchmarks/gpu_check.py --quick: the GPU check's code runs end to end on the CPU (so it does not rot before a GPU)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_fills_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(out.read_text())
    for section in ("environment", "parity", "prefill", "decode", "training"):
        assert "error" not in results[section], (section, results[section])
    # the converted model is the source model with the aux flow off, and at the upcycling init with it on
    assert results["parity"]["aux_off_max_abs_diff"] <= 1e-5
    assert results["parity"]["aux_on_max_abs_diff"] <= 1e-4
    assert results["parity"]["greedy_tokens_equal"]
    assert set(results["decode"]) == {"1", "16"}
    for entry in results["decode"].values():
        assert entry["byte_limit"]["ratio"] >= 1.0 and {"dynamic", "static"} <= entry.keys()
    # a training step at a random init: CE(aux) + CE(primary), each near ln(vocab) as the logits are near uniform, and
    # the backward reaches every weight of both flows
    training = results["training"]["sdpa"]
    assert training["loss"] == pytest.approx(2 * math.log(results["model"]["vocab_size"]), abs=0.05)
    assert training["parameters_without_grad"] == []
    assert "decode batch 16  static  dual/primary" in run.stdout
