"""Output projection on CPU: the transposed-matmul path (`W @ x.T`) vs plain `F.linear` (`x @ W.T`), issue 12.1.

    python benchmarks/lm_head_cpu.py [--hidden 2048 --vocab 128256 --rows 1 2 4 16 64 --threads 2 --rounds 20]

For each row count (1-2 rows: a decode step at batch 1, primary + aux row; 16: the old fast-path limit; 64: a prefill chunk) both variants run on
the same weight and input, interleaved in an order that alternates every round, so background load hits both alike.
Prints the median time per call of each, the median of the per-round ratios with its standard error, and checks that
both give the same logits.
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

from dualflow.instruments.probes import rotated, seconds


def transposed_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` computed as `(W @ x.T).T` (one row is doubled: a single column would take the gemv path)."""
    rows = x.shape[0]
    columns = x.T if rows > 1 else torch.cat([x, x]).T
    return (weight @ columns)[:, :rows].T.contiguous()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden) * 0.02
    variants = {"F.linear": F.linear, "W @ x.T": transposed_matmul}
    print(f"hidden {args.hidden}, vocab {args.vocab}, fp32, {args.threads} threads, {args.rounds} rounds")
    print(f"{'rows':>5} {'F.linear ms':>12} {'W @ x.T ms':>11} {'ratio (W@x.T / F.linear)':>26}")
    with torch.no_grad():
        for rows in args.rows:
            x = torch.randn(rows, args.hidden)
            torch.testing.assert_close(transposed_matmul(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-4)
            for fn in variants.values():  # warm-up
                fn(x, weight)
            times = {name: [] for name in variants}
            for round_index in range(args.rounds):
                for name in rotated(list(variants), round_index):
                    times[name].append(seconds(variants[name], x, weight))
            ratios = [t / f for t, f in zip(times["W @ x.T"], times["F.linear"])]
            error = statistics.stdev(ratios) / len(ratios) ** 0.5
            medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
            print(
                f"{rows:>5} {medians['F.linear']:>12.2f} {medians['W @ x.T']:>11.2f} "
                f"{statistics.median(ratios):>17.2f} ± {error:.2f}"
            )


if __name__ == "__main__":
    main()
