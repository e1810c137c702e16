"""The supported transformers range: what pyproject.toml declares is what CI tests at both ends."""

import re
from pathlib import Path

import transformers
from packaging.requirements import Requirement
from packaging.version import Version


ROOT = Path(__file__).resolve().parents[1]


def transformers_requirement() -> Requirement:
    return Requirement(re.search(r'"(transformers[<>=!~][^"]*)"', (ROOT / "pyproject.toml").read_text())[1])


def test_installed_transformers_is_in_the_supported_range():
    assert transformers_requirement().specifier.contains(transformers.__version__), transformers.__version__


def test_ci_tests_the_lowest_supported_transformers():
    lower_bounds = [Version(s.version) for s in transformers_requirement().specifier if s.operator == ">="]
    pinned = re.findall(r'TRANSFORMERS_SPEC="transformers==([\d.]+)"', (ROOT / ".ci" / "run").read_text())
    assert len(lower_bounds) == 1 and [Version(v) for v in pinned] == lower_bounds
