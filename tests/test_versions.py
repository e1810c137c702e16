"""The supported transformers range: what pyproject.toml declares is what CI tests at both ends."""

import re
import subprocess
import sys
from pathlib import Path

import transformers
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version
from pip._vendor import tomli  # pip's own TOML reader: these tests also run on Python 3.10, which has no tomllib


ROOT = Path(__file__).resolve().parents[1]


def transformers_requirement() -> Requirement:
    return Requirement(re.search(r'"(transformers[<>=!~][^"]*)"', (ROOT / "pyproject.toml").read_text())[1])


def test_installed_transformers_is_in_the_supported_range():
    assert transformers_requirement().specifier.contains(transformers.__version__), transformers.__version__


def test_ci_tests_the_lowest_supported_transformers():
    lower_bounds = [Version(s.version) for s in transformers_requirement().specifier if s.operator == ">="]
    pinned = re.findall(r'TRANSFORMERS_SPEC="transformers==([\d.]+)"', (ROOT / ".ci" / "run").read_text())
    assert len(lower_bounds) == 1 and [Version(v) for v in pinned] == lower_bounds


def test_bootstrap_vllm_lists_the_dependencies_without_tomllib():
    # requires-python is >=3.10, which has no tomllib: the Python step of scripts/bootstrap_vllm.sh must not need it.
    script = (ROOT / "scripts" / "bootstrap_vllm.sh").read_text()
    step = script.split("<<'PY'", 1)[1].split("\n", 1)[1].split("\nPY\n", 1)[0]
    code = "import sys\nsys.modules['tomllib'] = None\n" + step
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    listed = {(canonicalize_name(r.name), r.specifier) for r in map(Requirement, completed.stdout.splitlines())}
    declared = map(Requirement, tomli.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    expected = {(canonicalize_name(r.name), r.specifier) for r in declared if r.name not in ("torch", "transformers")}
    assert listed == expected and ("peft", SpecifierSet(">=0.21,<0.22")) in listed
