"""How fast synthetic workloads are drawn: 100,000 gamma arrivals with lognormal prompts.

    python benchmarks/workload_speed.py [--repeats 5] [--num-requests 100000]

Prints one line per run and, last, the median run:
    workload_speed: <requests> requests, <wall_s> wall s, <req/s> req/s
"""

from __future__ import annotations

import argparse
import time

from disagg.core.workload import WorkloadConfig, generate


def once(num_requests: int, seed: int) -> tuple[int, float]:
    cfg = WorkloadConfig.model_validate(
        {
            "arrival": "gamma",
            "num_requests": num_requests,
            "prompt_tokens": {"dist": "lognormal", "mean": 1000, "sigma": 1.0},
            "output_tokens": {"dist": "uniform", "low": 10, "high": 300},
        }
    )
    start = time.perf_counter()
    arrivals = generate(cfg, seed)
    wall = time.perf_counter() - start
    return len(arrivals), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-requests", type=int, default=100_000)
    args = ap.parse_args()
    runs = []
    for i in range(args.repeats):
        n, wall = once(args.num_requests, seed=i)
        runs.append((wall, n))
        print(f"run {i}: {n} requests, {wall:.3f} wall s")
    wall, n = sorted(runs)[len(runs) // 2]  # the median run (odd repeats)
    print(f"workload_speed: {n} requests, {wall:.3f} wall s, {n / wall:.0f} req/s")


if __name__ == "__main__":
    main()
