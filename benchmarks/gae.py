"""Time the reference GAE loop against the vectorised scan, side by side.

    python benchmarks/gae.py [--batch 64] [--lengths 128 1024 4096] [--repeats 7] [--threads N]

fp32 on the CPU, random prefix masks (every row at least one valid token), one warm-up
call then the median of ``--repeats`` calls per function. Prints a table and the speed-up
ratios; the last line is ``gae speedup at T=1024: <x.xx>``. Timings are never asserted.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout
from trl_ppo_ext.functional import masked_gae, masked_gae_loop

GAMMA, GAE_LAMBDA = 1.0, 0.95  # TRL's PPO defaults


def random_rollout(batch: int, length: int, generator: torch.Generator):
    """Rewards (B, T), values (B, T) and a random prefix response_mask (B, T)."""
    rewards = torch.randn(batch, length, generator=generator)
    values = torch.randn(batch, length, generator=generator)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return rewards, values, mask


def median_seconds(fn, args, repeats: int) -> float:
    fn(*args)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, fp32, B={args.batch}, gamma={GAMMA}, "
        f"lambda={GAE_LAMBDA}, median of {args.repeats}"
    )
    print(f"{'T':>6} | {'loop (ms)':>10} | {'vectorised (ms)':>15} | {'speed-up':>8}")
    print("-" * 50)
    generator = torch.Generator().manual_seed(0)
    speedups = {}
    for length in args.lengths:
        rollout = (*random_rollout(args.batch, length, generator), GAMMA, GAE_LAMBDA)
        loop = median_seconds(masked_gae_loop, rollout, args.repeats)
        vectorised = median_seconds(masked_gae, rollout, args.repeats)
        speedups[length] = loop / vectorised
        print(
            f"{length:>6} | {loop * 1e3:>10.2f} | {vectorised * 1e3:>15.2f} | "
            f"{speedups[length]:>7.2f}x"
        )
    print("speed-ups: " + ", ".join(f"T={t}: {s:.2f}x" for t, s in speedups.items()))
    if 1024 in speedups:
        print(f"gae speedup at T=1024: {speedups[1024]:.2f}")


if __name__ == "__main__":
    main()
