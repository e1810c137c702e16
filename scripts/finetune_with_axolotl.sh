#!/usr/bin/env bash
# Fine-tune a Dual-Flow checkpoint with Axolotl (LoRA, remote code), then load the result with transformers + PEFT
# and generate. Not run by CI (the install pulls ~7 GB: Axolotl 0.21.0 pins transformers 5.20.1, torch >=2.13,<2.15,
# xformers, triton, bitsandbytes). Recorded run: docs/results/README.md, "Axolotl: a LoRA run on a Dual-Flow checkpoint".
#
#   bash scripts/finetune_with_axolotl.sh [WORKDIR]      # default WORKDIR: /tmp/dualflow-axolotl
#
# Environment: PYTHON312 (a Python >= 3.12: Axolotl 0.21.0 requires it; default python3.12 on PATH, else pyenv's 3.12),
# AXOLOTL_VENV (default WORKDIR/venv; reused when it already has axolotl), STEPS (default 10).
# LLaMA-Factory 0.9.5 was tried first and does not install beside this package (it pins transformers <=5.6.0).
set -euo pipefail
export AXOLOTL_DO_NOT_TRACK=1  # no telemetry (with no network its upload retries hold the process after training)

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-/tmp/dualflow-axolotl}"
VENV="${AXOLOTL_VENV:-$WORK/venv}"
STEPS="${STEPS:-10}"
mkdir -p "$WORK"
cd "$WORK"

PY="${PYTHON312:-}"
if [[ -z "$PY" ]]; then
    PY="$(command -v python3.12 || true)"
    [[ -z "$PY" && -x "$HOME/.pyenv/versions/3.12.1/bin/python" ]] && PY="$HOME/.pyenv/versions/3.12.1/bin/python"
fi
[[ -n "$PY" ]] || { echo "Axolotl 0.21.0 needs Python >= 3.12; set PYTHON312" >&2; exit 1; }

if [[ ! -x "$VENV/bin/axolotl" ]]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q -U pip
    # torch pinned to the version the project uses; on Python 3.12 this is PyPI's CUDA build (it runs on a CPU too)
    "$VENV/bin/pip" install torch==2.13.0 axolotl==0.21.0
    # the package itself, without letting it move Axolotl's pins (its own deps are already there)
    "$VENV/bin/pip" install --no-deps -e "$REPO"
fi
"$VENV/bin/pip" list 2>/dev/null | grep -iE "^(axolotl|transformers|torch|peft|accelerate|trl|datasets) " || true

# 1. a tiny Qwen3-MoE (transformers' own class, byte-level tokenizer), converted to Dual-Flow (k_a = 4 > k_p = 2)
"$VENV/bin/python" - <<'PY'
import torch
from transformers import ByT5Tokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM
torch.manual_seed(0)
tok = ByT5Tokenizer()
cfg = Qwen3MoeConfig(vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                     num_experts_per_tok=2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     bos_token_id=None)
Qwen3MoeForCausalLM(cfg).save_pretrained("tiny-qwen3moe")
tok.save_pretrained("tiny-qwen3moe")
PY
rm -rf tiny-dualflow
"$VENV/bin/dualflow" convert tiny-qwen3moe tiny-dualflow --aux-top-k 4 --verify

# 2. data: 80 rows of 120 characters of a Python standard-library source file
"$VENV/bin/python" - <<'PY'
import json, os
text = open(os.__file__, encoding="utf-8").read()
with open("data.jsonl", "w") as f:
    for start in range(0, 80 * 120, 120):
        f.write(json.dumps({"text": text[start : start + 120]}) + "\n")
PY

# 3. the config (paths relative to WORK) and the run; CUDA_VISIBLE_DEVICES="" keeps it on the CPU
sed -e "s/^max_steps: .*/max_steps: $STEPS/" "$REPO/scripts/axolotl_dualflow_lora.yml" > config.yml
rm -rf axolotl-lora-out axolotl-prepared
start=$(date +%s)
# axolotl starts the run through `accelerate launch`, found on PATH
PATH="$VENV/bin:$PATH" CUDA_VISIBLE_DEVICES="" "$VENV/bin/axolotl" train config.yml 2>&1 | tee train.log
echo "axolotl train: $(( $(date +%s) - start )) s"

# 4. the adapter loads on the Dual-Flow checkpoint with transformers (remote code) + PEFT and generates
CUDA_VISIBLE_DEVICES="" "$VENV/bin/python" - <<'PY'
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained("tiny-dualflow", trust_remote_code=True)
base = AutoModelForCausalLM.from_pretrained("tiny-dualflow", trust_remote_code=True)
print("base class:", type(base).__module__, type(base).__name__)
ref = AutoModelForCausalLM.from_pretrained("tiny-dualflow", trust_remote_code=True)
model = PeftModel.from_pretrained(base, "axolotl-lora-out").merge_and_unload()
inputs = tok(["def main():"], return_tensors="pt")
with torch.no_grad():
    diff = (model(**inputs).logits - ref(**inputs).logits).abs().max().item()
print(f"max |logit change| from the adapter: {diff:.4f}")
assert diff > 0, "the adapter changed nothing"
out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
print("generate (aux flow):", repr(tok.batch_decode(out)[0]))
out = model.generate(**inputs, max_new_tokens=16, do_sample=False, use_aux_flow=False)
print("generate (primary flow):", repr(tok.batch_decode(out)[0]))
model.save_pretrained("merged")
tok.save_pretrained("merged")
again = AutoModelForCausalLM.from_pretrained("merged", trust_remote_code=True)
with torch.no_grad():
    print("merged folder reloads, logits equal:", torch.allclose(again(**inputs).logits, model(**inputs).logits))
PY

# 5. full fine-tuning: the same config without the adapter (lr 1e-3); the output folder is a model folder
sed -e '/^adapter:/d; /^lora_/d; s#^output_dir: .*#output_dir: ./axolotl-full-out#; s/^learning_rate: .*/learning_rate: 0.001/' \
    config.yml > config-full.yml
rm -rf axolotl-full-out
start=$(date +%s)
PATH="$VENV/bin:$PATH" CUDA_VISIBLE_DEVICES="" "$VENV/bin/axolotl" train config-full.yml 2>&1 | tee train-full.log
echo "axolotl train (full): $(( $(date +%s) - start )) s"
CUDA_VISIBLE_DEVICES="" "$VENV/bin/python" - <<'PY'
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained("axolotl-full-out", trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained("axolotl-full-out", trust_remote_code=True)
ref = AutoModelForCausalLM.from_pretrained("tiny-dualflow", trust_remote_code=True)
inputs = tok(["def main():"], return_tensors="pt")
print("full: class", type(model).__module__, type(model).__name__)
with torch.no_grad():
    print("full: max |logit change|", (model(**inputs).logits - ref(**inputs).logits).abs().max().item())
print("full: aux embedding changed", not torch.equal(model.model.aux_embed_tokens.weight, ref.model.aux_embed_tokens.weight))
print("full: generate", repr(tok.batch_decode(model.generate(**inputs, max_new_tokens=16, do_sample=False))[0]))
PY
