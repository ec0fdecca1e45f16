"""Setup and step cost of DistributedOptimizer's param index (fix 0003), pristine vs patched.

Setup: times ``DistributedOptimizer._build_optimizer_group_ranges`` (where the patch builds the
index in group storage order) on synthetic grad-buffer ranges of 1k, 10k and 100k params:
alternating bf16/fp32 buffers (as with VPP), two optimizer groups.

Step (only with CUDA): an NCCL world of size 1 with ``parallel_state``, a bf16 Linear -> fp32
child Linear -> bf16 Linear model (hidden ``HIDDEN``, about 12.6M params) in
``DistributedDataParallel`` with ``use_distributed_optimizer=True`` and the optimizer from
``get_megatron_optimizer`` (adam, bf16), built as the fix's GPU test builds them. After
``WARMUP`` untimed steps, each of ``--steps`` steps does zero_grad_buffer, forward, backward and
finish_grad_sync untimed, then times ``optimizer.step()`` alone between two
``torch.cuda.synchronize()``. The trees alternate over ``--rounds``.

Each tree is imported in its own subprocess, so both versions are measured in one run:

    python bench/bench_distopt_index.py --pristine /path/to/pristine --patched /path/to/patched

Only the stdlib and torch are needed (plus what the trees' ``megatron.core`` imports).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

DEFAULT_SIZES = (1_000, 10_000, 100_000)
NUM_BUFFERS = 4  # bf16, fp32, bf16, fp32
HIDDEN = 2048  # step model: three HIDDEN x HIDDEN Linears, bf16 / fp32 / bf16
TOKENS = 64  # rows of the step model's input
WARMUP = 5  # untimed steps before the timed ones


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


def _measure_step(tree: str, steps: int) -> list[float]:
    """In a child process (CUDA): milliseconds of each timed ``optimizer.step()``."""
    sys.path.insert(0, tree)
    import logging

    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    logging.disable(logging.WARNING)

    class Fp32Child(torch.nn.Module):
        """An fp32 submodule inside a bf16 model (as mark_keep_in_fp32 produces)."""

        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(HIDDEN, HIDDEN, device="cuda")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x.float()).to(torch.bfloat16)

    class MixedNet(torch.nn.Module):
        """bf16 Linear, fp32 child, bf16 Linear: DDP builds a bf16 buffer, then an fp32 one."""

        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(HIDDEN, HIDDEN, dtype=torch.bfloat16, device="cuda")
            self.child = Fp32Child()
            self.out = torch.nn.Linear(HIDDEN, HIDDEN, dtype=torch.bfloat16, device="cuda")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.child(self.inp(x)))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        torch.manual_seed(1234)
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
        model = DistributedDataParallel(
            TransformerConfig(num_attention_heads=1, num_layers=1), ddp_config, MixedNet()
        )
        config = OptimizerConfig(
            optimizer="adam",
            lr=1e-4,
            weight_decay=0.0,
            clip_grad=0.0,
            bf16=True,
            use_distributed_optimizer=True,
        )
        optimizer = get_megatron_optimizer(config, [model])
        x = torch.randn(TOKENS, HIDDEN, device="cuda").to(torch.bfloat16)
        times_ms: list[float] = []
        for step in range(WARMUP + steps):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            model(x).float().square().mean().backward()
            model.finish_grad_sync()
            torch.cuda.synchronize()
            start = time.perf_counter()
            optimizer.step()
            torch.cuda.synchronize()
            if step >= WARMUP:
                times_ms.append((time.perf_counter() - start) * 1e3)
        return times_ms
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _run_child(tree: str, args: list[str]) -> Any:
    """Run this script on ``tree`` in a fresh interpreter; its last stdout line, as JSON."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tree, *args]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        sys.exit(f"{' '.join(cmd)}: exit status {proc.returncode}\n{tail}")
    return json.loads(lines[-1])


def _step_table(trees: dict[str, str], steps: int, rounds: int) -> None:
    times: dict[str, list[float]] = {name: [] for name in trees}
    for round_index in range(rounds):
        for name in list(trees)[:: 1 if round_index % 2 == 0 else -1]:
            times[name] += _run_child(trees[name], ["--step-time", "--steps", str(steps)])
    pristine, patched = (statistics.median(times[name]) for name in ("pristine", "patched"))
    print(
        f"\noptimizer.step(), NCCL world size 1, bf16/fp32/bf16 Linears {HIDDEN}x{HIDDEN}, "
        f"{rounds} rounds x {steps} steps (+{WARMUP} warm-up), trees alternating"
    )
    print(f"{'pristine ms':>11} | {'patched ms':>10} | {'patched/pristine':>16}")
    print(f"{'-' * 11}-+-{'-' * 10}-+-{'-' * 16}")
    print(f"{pristine:>11.3f} | {patched:>10.3f} | {patched / pristine:>16.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pristine", help="tree (holding megatron/core) without the patch")
    parser.add_argument("--patched", help="tree (holding megatron/core) with the patch")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per round and tree")
    parser.add_argument("--rounds", type=int, default=3, help="step rounds; the trees alternate")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--step-time", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        if args.step_time:
            print(json.dumps(_measure_step(args.child, args.steps)))
        else:
            print(json.dumps(_measure(args.child, args.sizes, args.repeats)))
        return
    if not (args.pristine and args.patched):
        parser.error("--pristine and --patched are required")
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    setup_args = ["--repeats", str(args.repeats), "--sizes", *map(str, args.sizes)]
    pristine = {int(k): v for k, v in _run_child(args.pristine, setup_args).items()}
    patched = {int(k): v for k, v in _run_child(args.patched, setup_args).items()}
    print(f"{'params':>8} | {'pristine ms':>11} | {'patched ms':>10} | {'added ms':>8}")
    print(f"{'-' * 8}-+-{'-' * 11}-+-{'-' * 10}-+-{'-' * 8}")
    for size in args.sizes:
        added = patched[size] - pristine[size]
        print(f"{size:>8} | {pristine[size]:>11.2f} | {patched[size]:>10.2f} | {added:>8.2f}")

    import torch

    if not torch.cuda.is_available():
        print("\nstep time: skipped (CUDA is not available)")
        return
    _step_table({"pristine": args.pristine, "patched": args.patched}, args.steps, args.rounds)


if __name__ == "__main__":
    main()
