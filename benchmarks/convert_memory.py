"""Peak memory and wall time of `dualflow convert` vs loading the same checkpoint whole with transformers.

Builds a random multi-shard Mixtral-style checkpoint with transformers (a few hundred MB, fp32), then measures in
fresh child processes, one after the other:
  baseline      python + torch + transformers + dualflow.convert imported, nothing else
  convert       convert_checkpoint(src, out) with the default --max-shard-size 5GB
  from_pretrained  AutoModelForCausalLM.from_pretrained(src) (what any whole-model conversion needs at least)
Peak RSS is each child's VmHWM from /proc/self/status (Linux). Not getrusage: Linux carries ru_maxrss across fork and
exec, so children of this process (which built the checkpoint) would all report its peak.

With --fp8 the checkpoint is made block FP8, as the FP8 releases store it: every projection weight float8_e4m3fn
with float32 scales per 128 x 128 block (here all 1: the memory does not depend on the values), the rest unquantized;
`dualflow convert` dequantizes it while streaming and from_pretrained dequantizes it on load (transformers does on CPU).

    python benchmarks/convert_memory.py [--hidden 512] [--layers 6] [--fp8] [--workdir /tmp/dualflow-convert-bench]
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


CHILD = """
import json, re, sys, time
import torch, transformers
from dualflow.convert import convert_checkpoint
mode, src, out = sys.argv[1:4]
start = time.perf_counter()
if mode == "convert":
    convert_checkpoint(src, out, show_progress=False)
elif mode == "from_pretrained":
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype="auto")
wall_s = time.perf_counter() - start
peak_kib = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
print(json.dumps({"peak_rss_bytes": peak_kib * 1024, "wall_s": wall_s}))
"""


def make_checkpoint(folder: Path, hidden: int, layers: int):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
    )
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(folder, max_shard_size="50MB")
    return config


def make_block_fp8(folder: Path):
    """Turn the saved checkpoint into a block-FP8 one: projection weights float8 with unit scales per block."""
    import torch
    from safetensors.torch import load_file, save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(shard)
        for key in [key for key in tensors if key.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))]:
            rows, columns = tensors[key].shape
            tensors[key] = tensors[key].to(torch.float8_e4m3fn)
            tensors[key + "_scale_inv"] = torch.ones(-(-rows // 128), -(-columns // 128))
            index["weight_map"][key + "_scale_inv"] = shard.name
        save_file(tensors, shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (folder / "config.json").write_text(json.dumps(config))


def measure(mode: str, src: Path, out: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(src), str(out)], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--fp8", action="store_true", help="make the checkpoint block FP8")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dualflow-convert-bench-"))
    src, out = workdir / "src", workdir / "out"
    for stale in (src, out, workdir / "warmup"):  # a rerun with the same --workdir: convert refuses an existing OUT
        shutil.rmtree(stale, ignore_errors=True)
    make_checkpoint(src, args.hidden, args.layers)
    if args.fp8:
        make_block_fp8(src)
    size = sum(path.stat().st_size for path in src.glob("*.safetensors"))
    shards = len(list(src.glob("*.safetensors")))

    measure("convert", src, workdir / "warmup")  # warm the page cache so both contenders read from memory
    shutil.rmtree(workdir / "warmup")
    baseline = measure("baseline", src, out)
    convert = measure("convert", src, out)
    whole = measure("from_pretrained", src, out)

    mib = 2**20
    kind = "block FP8 projections, the rest fp32" if args.fp8 else "fp32"
    print(f"checkpoint: {size / mib:.0f} MiB in {shards} shards ({kind}), {src}")
    print(f"{'':16s} {'peak RSS MiB':>12s} {'above baseline':>15s} {'wall s':>7s}")
    for name, row in [("baseline", baseline), ("convert", convert), ("from_pretrained", whole)]:
        extra = (row["peak_rss_bytes"] - baseline["peak_rss_bytes"]) / mib
        print(f"{name:16s} {row['peak_rss_bytes'] / mib:12.0f} {extra:15.0f} {row['wall_s']:7.2f}")
    convert_extra = convert["peak_rss_bytes"] - baseline["peak_rss_bytes"]
    whole_extra = whole["peak_rss_bytes"] - baseline["peak_rss_bytes"]
    print(f"memory above baseline, from_pretrained / convert: {whole_extra / max(convert_extra, 1):.1f}x")
    if args.workdir is None:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
