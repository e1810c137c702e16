"""Training cost per token of `dualflow experiment` arms, side by side in one run: dual-flow designs against
single-flow k2.

    python benchmarks/train_step_cost.py [--steps 4 --repeats 3 --arms "single k2" "dual kp2 ka4 aux emb copied"]

One torch thread, the experiment's default scale (batch 8 x 128, hidden 96, 3 layers); CPU seconds per training step
(forward + backward with labels, as in training), measured in an order rotated every repeat so background load and
warm caches favour no arm; medians, and each arm's cost as a multiple of single k2's.
"""

import argparse
import statistics
import time

import torch

from dualflow.instruments.arms import ARMS_BY_NAME, DEFAULT_SCALE, arm_costs
from modeling_dualflow import DualFlowForCausalLM


BEST = "dual kp2 ka4 r2 gate 1 aux emb copied plw 0.5"
DEFAULT_ARMS = [
    "single k2",
    BEST,
    "dual kp2 ka4 aux emb copied",
]


def step_cpu_seconds(model, input_ids, steps: int) -> float:
    start = time.process_time()
    for _ in range(steps):
        model(input_ids, labels=input_ids, output_router_logits=True).loss.backward()
    return (time.process_time() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per arm and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arms", nargs="+", default=DEFAULT_ARMS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    scale = DEFAULT_SCALE
    input_ids = torch.randint(0, 256, (scale.batch_size, scale.block_size), generator=torch.Generator().manual_seed(0))
    models = {}
    for name in args.arms:
        torch.manual_seed(0)
        models[name] = DualFlowForCausalLM(ARMS_BY_NAME[name].model_config(scale)).train()
        step_cpu_seconds(models[name], input_ids, 1)  # warm-up
    times = {name: [] for name in args.arms}
    for repeat in range(args.repeats):
        shift = repeat % len(args.arms)
        for name in args.arms[shift:] + args.arms[:shift]:
            times[name].append(step_cpu_seconds(models[name], input_ids, args.steps))
    baseline = statistics.median(times[args.arms[0]])
    baseline_flops = arm_costs(ARMS_BY_NAME[args.arms[0]], scale)["train_flops_per_token"]
    print(f"{'arm':<52} {'CPU ms/step':>11} {'x ' + args.arms[0]:>12} {'FLOPs x':>8}")
    for name in args.arms:
        median = statistics.median(times[name])
        flops = arm_costs(ARMS_BY_NAME[name], scale)["train_flops_per_token"] / baseline_flops
        print(f"{name:<52} {1000 * median:>11.1f} {median / baseline:>12.2f} {flops:>8.2f}")


if __name__ == "__main__":
    main()
