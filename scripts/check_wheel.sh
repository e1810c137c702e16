#!/usr/bin/env bash
# Build the wheel from the working tree and use it the way a user of the release does: installed with its
# dependencies into a fresh virtual environment, run from a folder outside the repository (so nothing can be imported
# from the checkout), and a converted folder loaded as remote code once the package is uninstalled.
# torch is installed first as in scripts/bootstrap.sh (TORCH_SPEC overrides it); the rest comes from the index.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
work=$(mktemp -d -t dualflow-wheel-XXXXXX)
trap 'rm -rf "$work"' EXIT

# The build runs in a copy of the tracked and not-ignored files: an in-tree build would write build/ and egg-info
# beside other environments' editable installs, and could pack stale files left in build/ by an earlier build.
mkdir "$work/src" "$work/dist" "$work/run"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' path; do
    if [ -e "$path" ]; then cp --parents -- "$path" "$work/src"; fi  # a tracked file may be deleted in the tree
done
python3 -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/dualflow_transformers-*.whl)
version=$(basename "$wheel" | cut -d- -f2)
echo "[wheel] built $(basename "$wheel")"

# Package data in, repository-only folders out.
python3 - "$wheel" model_cards/*.md <<'EOF'
import sys
import zipfile
from pathlib import Path

names = zipfile.ZipFile(sys.argv[1]).namelist()
cards = {f"dualflow/model_cards/{Path(card).name}" for card in sys.argv[2:]}
missing = sorted(cards - set(names))
assert not missing, f"model cards missing from the wheel: {missing}"
stray = sorted(name for name in names if name.split("/")[0] in ("tests", "benchmarks", "scripts", "docs", "convert"))
assert not stray, f"repository files in the wheel: {stray}"
assert "modeling_dualflow/modeling_dualflow.py" in names and "dualflow/convert/converter.py" in names, names
print(f"[wheel] {len(names)} files, model cards {sorted(Path(card).name for card in cards)}, no tests")
EOF

python3 -m venv "$work/venv"
python="$work/venv/bin/python"
"$python" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
"$python" -m pip install -q "$wheel"
echo "[wheel] installed into a fresh venv with its dependencies ($((SECONDS - started)) s so far)"

# From here on: no checkout on the path, no user site-packages, no Hub.
cd "$work/run"
unset PYTHONPATH
export PYTHONNOUSERSITE=1 HF_HOME="$work/hf-home" HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TQDM_DISABLE=1
"$python" - <<'EOF'
import sysconfig
from pathlib import Path

import dualflow
import modeling_dualflow

site = Path(sysconfig.get_paths()["purelib"])
for module in (dualflow, modeling_dualflow):
    assert Path(module.__file__).is_relative_to(site), f"{module.__name__} imported from {module.__file__}, not {site}"
print("[wheel] dualflow and modeling_dualflow import from the venv's site-packages")
EOF
"$work/venv/bin/dualflow" --help >/dev/null
reported=$("$work/venv/bin/dualflow" --version)
[ "$reported" = "dualflow $version" ] || { echo "[wheel] dualflow --version says '$reported', the wheel is $version"; exit 1; }
echo "[wheel] $reported"

"$python" - <<'EOF'
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

config = Qwen3MoeConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
)
Qwen3MoeForCausalLM(config).save_pretrained("tiny-qwen3-moe")
EOF
"$work/venv/bin/dualflow" convert tiny-qwen3-moe tiny-dualflow --aux-top-k 4 --verify
# The installed package's logits, for the remote-code load below to match.
"$python" -c "
import torch
from modeling_dualflow import DualFlowForCausalLM
model = DualFlowForCausalLM.from_pretrained('tiny-dualflow').eval()
with torch.no_grad():
    torch.save(model(torch.arange(1, 17)[None]).logits, 'logits.pt')
"

"$python" -m pip uninstall -q -y dualflow-transformers
"$python" - <<'EOF'
import importlib.util

import torch
from transformers import AutoModelForCausalLM

assert importlib.util.find_spec("modeling_dualflow") is None and importlib.util.find_spec("dualflow") is None
model = AutoModelForCausalLM.from_pretrained("tiny-dualflow", trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
with torch.no_grad():
    logits = model(torch.arange(1, 17)[None]).logits
assert torch.equal(logits, torch.load("logits.pt")), "remote code and the installed package disagree"
model.generate(torch.arange(1, 5)[None], max_new_tokens=4, do_sample=False)
print(f"[wheel] loaded as remote code ({type(model).__module__}) without the package: same logits, generate runs")
EOF
echo "[wheel] dualflow-transformers $version checked in $((SECONDS - started)) s"
