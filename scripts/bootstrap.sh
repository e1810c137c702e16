#!/usr/bin/env bash
# Create .venv and install the package. torch is pinned first to the CPU wheel this project is tested with
# (override with TORCH_SPEC, e.g. TORCH_SPEC="torch" for your platform's default build).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ".[test]"
