"""The `dualflow` command line: the commands it lists, and a --help that imports neither torch nor transformers."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

from dualflow.cli import COMMANDS


HEAVY = ("torch", "transformers", "huggingface_hub")


def run_cli(*argv) -> subprocess.CompletedProcess:
    code = (
        "import sys\nfrom dualflow.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as exit:\n    status = exit.code\n"
        f"print('heavy imports:', [name for name in {HEAVY!r} if name in sys.modules], file=sys.stderr)\n"
        "sys.exit(status)"
    )
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)


def test_help_lists_every_command_without_heavy_imports():
    completed = run_cli("--help")
    assert completed.returncode == 0
    assert completed.stderr.strip() == "heavy imports: []"
    assert set(COMMANDS) == {"demo", "convert", "finetune", "push", "compare", "experiment"}
    for name, (_, help_text) in COMMANDS.items():
        assert f"    {name}" in completed.stdout and help_text.split()[0] in completed.stdout


def test_unknown_command_and_missing_command_are_usage_errors_without_heavy_imports():
    for argv in (("frobnicate",), ()):
        completed = run_cli(*argv)
        assert completed.returncode == 2
        assert "usage: dualflow" in completed.stderr and "heavy imports: []" in completed.stderr


def test_each_command_has_its_own_help():
    for name, (module, _) in COMMANDS.items():
        assert (
            f"usage: dualflow {name}" in importlib.import_module(module).build_parser(f"dualflow {name}").format_help()
        )


def test_core_tools_work_without_the_instruments_extra():
    # As after `pip install -e .` without extras: matplotlib missing; the tools import and write a model card.
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "import dualflow.convert.cli, dualflow.finetune, dualflow.hub\n"
        "from helpers import tiny_config\n"
        "from dualflow.model_card import render_model_card\n"
        "assert 'dual-flow' in str(render_model_card(tiny_config(), repo_id='someone/tiny'))\n"
    )
    tests_dir = str(Path(__file__).parent)
    completed = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": tests_dir},
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
