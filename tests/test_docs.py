"""Every code block of README.md and docs/ runs as written, offline, in a scratch folder (blocks of one page in order).

A block that cannot run here (the Hub, torchrun, a long measurement) says why in a `<!-- not run: ... -->` line right
above it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, code_blocks, runnable_blocks


PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
TEST_COMMAND = "bash scripts/bootstrap.sh && .venv/bin/python -m pytest -q -p no:cacheprovider tests"


def test_every_block_runs_or_says_why_not():
    for page in PAGES:
        for block in code_blocks(page):
            name = f"{page.relative_to(ROOT)}: {block['code'].splitlines()[0]!r}"
            assert block["language"] in ("python", "bash"), f"{name}: unknown language {block['language']!r}"
            assert block["reason"] is None or block["reason"].strip(), name


def test_readme_test_command_is_what_ci_runs():
    blocks = [block["code"].strip() for block in code_blocks(ROOT / "README.md")]
    assert TEST_COMMAND in blocks
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize(
    "page", [page for page in PAGES if runnable_blocks(page)], ids=lambda page: str(page.relative_to(ROOT))
)
def test_code_blocks_run_as_written(page, tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    # `python` and `dualflow` in the blocks are this environment's.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    for block in runnable_blocks(page):
        command = [sys.executable, "-c", block["code"]] if block["language"] == "python" else ["bash", "-e", "-c"]
        if block["language"] == "bash":
            command.append(block["code"])
        completed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert completed.returncode == 0, f"{block['code']}\n--- stderr:\n{completed.stderr[-3000:]}"
