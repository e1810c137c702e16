"""
The tests clean up after themselves: a pytest session leaves nothing in the temp folder but pytest's own empty base
folder. Passed tests' tmp_path folders are removed (pyproject.toml's tmp_path_retention_policy), and so are the private
caches conftest.py and test modules make at import (the remote-code modules, lm-eval's datasets cache).
"""

import getpass
import os
import subprocess
import sys

from helpers import ROOT


def test_a_session_leaves_nothing_in_the_temp_folder(tmp_path):
    temp = tmp_path / "temp"
    temp.mkdir()
    env = dict(os.environ, TMPDIR=str(temp))
    for cache in ("HF_MODULES_CACHE", "HF_DATASETS_CACHE"):  # this session's: the child session makes its own
        env.pop(cache, None)
    tests = [
        "tests/test_plots.py::test_plot_compare_writes_the_figure_as_a_png",  # writes into its tmp_path
        "tests/test_lm_eval.py::test_documented_commands_give_the_backends_these_arguments",  # a datasets cache
    ]
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout[-3000:]
    left = sorted(str(path.relative_to(temp)) for path in temp.rglob("*"))
    assert left == [f"pytest-of-{getpass.getuser()}"], left  # where pytest numbers its sessions' folders
