#!/usr/bin/env bash
# Create a virtual environment (VENV, default .venv) and install the package. torch is pinned first to the CPU wheel
# this project is tested with (override with TORCH_SPEC, e.g. TORCH_SPEC="torch" for your platform's default build).
# transformers resolves to the newest supported 5.x; TRANSFORMERS_SPEC picks another one from the supported range
# (CI also tests its lowest end: TRANSFORMERS_SPEC="transformers==5.19.0" VENV=.venv-lowest).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
python3 -m venv "$venv"
"$venv"/bin/python -m pip install -q --upgrade pip
"$venv"/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
bash scripts/with_install_lock.sh "$venv"/bin/python -m pip install -q -e ".[test]" ${TRANSFORMERS_SPEC:+"$TRANSFORMERS_SPEC"}
