"""Setup-time cost of DistributedOptimizer's param index (fix 0003), pristine vs patched.

Times ``DistributedOptimizer._build_optimizer_group_ranges`` (where the patch builds the index in
group storage order) on synthetic grad-buffer ranges of 1k, 10k and 100k params: alternating
bf16/fp32 buffers (as with VPP), two optimizer groups. Each tree is imported in its own
subprocess, so both versions are measured in one run:

    python bench/bench_distopt_index.py --pristine /path/to/pristine --patched /path/to/patched

Only the stdlib and torch are needed (plus what the trees' ``megatron.core`` imports).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEFAULT_SIZES = (1_000, 10_000, 100_000)
NUM_BUFFERS = 4  # bf16, fp32, bf16, fp32


def _measure(tree: str, sizes: list[int], repeats: int) -> dict[int, float]:
    """In a child process: best-of-``repeats`` milliseconds per call, for each size."""
    sys.path.insert(0, tree)
    import logging

    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    logging.disable(logging.WARNING)
    results: dict[int, float] = {}
    for size in sizes:
        params = [
            torch.nn.Parameter(
                torch.empty(
                    4, dtype=torch.bfloat16 if (i * NUM_BUFFERS // size) % 2 == 0 else torch.float32
                )
            )
            for i in range(size)
        ]
        per_buffer = size // NUM_BUFFERS
        gbuf_ranges = [
            {
                (chunk[0].dtype, chunk[0].dtype): [
                    {"param_map": {p: None for p in chunk[: len(chunk) // 2]}},
                    {"param_map": {p: None for p in chunk[len(chunk) // 2 :]}},
                ]
            }
            for chunk in (params[b * per_buffer : (b + 1) * per_buffer] for b in range(NUM_BUFFERS))
        ]
        best = float("inf")
        for _ in range(repeats):
            param_groups = [{"params": params[0::2]}, {"params": params[1::2]}]
            start = time.perf_counter()
            DistributedOptimizer._build_optimizer_group_ranges(param_groups, gbuf_ranges)
            best = min(best, time.perf_counter() - start)
        results[size] = best * 1e3
    return results


def _run_child(tree: str, sizes: list[int], repeats: int) -> dict[int, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tree, "--repeats", str(repeats)]
    cmd += ["--sizes", *map(str, sizes)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pristine", help="tree (holding megatron/core) without the patch")
    parser.add_argument("--patched", help="tree (holding megatron/core) with the patch")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(_measure(args.child, args.sizes, args.repeats)))
        return
    if not (args.pristine and args.patched):
        parser.error("--pristine and --patched are required")
    pristine = _run_child(args.pristine, args.sizes, args.repeats)
    patched = _run_child(args.patched, args.sizes, args.repeats)
    print(f"{'params':>8} | {'pristine ms':>11} | {'patched ms':>10} | {'added ms':>8}")
    print(f"{'-' * 8}-+-{'-' * 11}-+-{'-' * 10}-+-{'-' * 8}")
    for size in args.sizes:
        added = patched[size] - pristine[size]
        print(f"{size:>8} | {pristine[size]:>11.2f} | {patched[size]:>10.2f} | {added:>8.2f}")


if __name__ == "__main__":
    main()
