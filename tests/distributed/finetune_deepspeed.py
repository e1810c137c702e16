"""
Run `dualflow finetune` several times in the same launched processes, as tests/test_deepspeed.py lists them in
PHASES.json, and write each run's exit status and the disk the run's free-space check asked for to RESULT.json:

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/finetune_deepspeed.py PHASES.json RESULT.json

A phase is {"argv": [...]} (the command's arguments) and, optionally, "unfinish": a folder whose finished run is
turned back into a run stopped after its last checkpoint (the final files removed, the marker written back, as a
SIGKILL while saving leaves it; "incomplete": [CHECKPOINT, COPY] adds a copy of a checkpoint without its DeepSpeed
`latest` file), done by rank 0 while the other processes wait. `--no-shim` leaves accelerate as it
is (DeepSpeed on a CPU then counts one process).
"""

import json
import shutil
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))
from deepspeed_on_cpu import treat_cpu_as_accelerator  # noqa: E402


def main():
    phases, result_file = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    if "--no-shim" not in sys.argv:
        treat_cpu_as_accelerator()
    import torch.distributed as dist

    from dualflow import output_folder
    from dualflow.cli import main as dualflow_main

    asked = []  # the bytes each run's free-space check asked for (the real check runs)
    check = output_folder.OutputFolder.check_free_space

    def recorded_check(self, needed_bytes, what):
        asked.append(needed_bytes)
        return check(self, needed_bytes, what)

    output_folder.OutputFolder.check_free_space = recorded_check
    results = []
    for phase in phases:
        if "unfinish" in phase:
            if dist.get_rank() == 0:
                out = Path(phase["unfinish"])
                for entry in out.iterdir():
                    if entry.is_file():
                        entry.unlink()
                (out / output_folder.UNFINISHED_MARKER).write_text(json.dumps({"command": "finetune"}))
                if "incomplete" in phase:  # a checkpoint whose DeepSpeed part was not written in full
                    source, copy = (Path(path) for path in phase["incomplete"])
                    shutil.copytree(source, copy)
                    (copy / "latest").unlink()
            dist.barrier()
        asked.clear()
        status = dualflow_main(["finetune", *phase["argv"]])
        results.append({"status": status, "asked_bytes": asked[-1] if asked else None})
        if dist.is_initialized():
            dist.barrier()
    rank = dist.get_rank() if dist.is_initialized() else 0
    result_file.with_name(f"{result_file.stem}-rank-{rank}.json").write_text(json.dumps(results))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
