"""MIMO run-time cost of fix 1: world collectives and time per MimoOptimizer.step().

Measures a patched and an unpatched (pristine) tree side by side in one run, each in its own
subprocess (so the two `megatron.core` imports never mix), on three precision paths: FP16 with
dynamic loss scaling, FP16 with a constant loss scale, BF16. Every figure is measured here.

    python bench/bench_mimo.py --patched build/trees/main --pristine /tmp/main-pristine
    python bench/bench_mimo.py ... --device cuda                    # 2 gloo ranks on GPU 0
    python bench/bench_mimo.py ... --device cuda --backend nccl --world-size 1

The tree roots hold `megatron/core` (a pristine tree: `git clone -q build/trees/main X &&
git -C X checkout pristine`). Each worker spawns a world (default: 2 gloo ranks on the host),
the encoder grid on rank 0 and the LLM grid on the last rank, builds inner optimizers with
MCore's optimizer builder (Float16OptimizerWithFloat16Params, SGD) and a real MimoOptimizer,
and times `step()` (gradients are set outside the timed region).

Measurement only, not the code under test: torch.distributed collectives are wrapped to count
the calls on the world group, and on the host (`--device cpu`) a TorchFunctionMode places
MCore's hard-coded `device='cuda'` allocations on the host. That mode costs the same on both
trees but inflates absolute CPU times; compare the ratio, or use `--device cuda`. Step times
of a shared host are noisy (other processes preempt a rank, and its peer waits in the next
collective): the trees alternate over `--rounds` and the best round counts, since such
interference only ever adds time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

PATHS = ("fp16_dynamic", "fp16_constant", "bf16")
ENCODER, LLM = "images", "language"
PROOFS = Path(__file__).resolve().parents[1] / "tests" / "proofs"


# --- worker side (runs with one tree on PYTHONPATH) -----------------------------------------


def _build_mimo(
    path: str, backend: str, device: str, world_size: int, hidden: int, llm_rank: int = -1
) -> tuple[Any, list[Any]]:
    """A MimoOptimizer over two one-rank grids, inner optimizers from MCore's builder.

    The encoder grid is rank 0, the LLM grid `llm_rank` (default: the last rank).
    """
    import torch
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.models.mimo.optimizer import MimoOptimizer, ModuleOptimizerInfo
    from megatron.core.optimizer import _get_megatron_optimizer_based_on_param_groups
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    kwargs: dict[str, Any] = dict(optimizer="sgd", lr=0.01, clip_grad=1.0)
    if path == "bf16":
        kwargs.update(bf16=True)
    elif path == "fp16_constant":
        kwargs.update(fp16=True, loss_scale=1024.0)
    else:
        kwargs.update(fp16=True, initial_loss_scale=1024.0, hysteresis=2)
    config = OptimizerConfig(**kwargs)
    dtype = torch.bfloat16 if path == "bf16" else torch.float16

    infos, modules = {}, []
    for name, offset in ((ENCODER, 0), (LLM, llm_rank % world_size)):
        grid = HyperCommGrid(
            [1, 1, 1, 1, 1], ["tp", "cp", "ep", "pp", "dp"], rank_offset=offset, backend=backend
        )
        for dims in ("tp", "pp", "dp", ["tp", "pp"]):
            grid.create_pg(dims)
        optimizer, pgs = None, None
        if grid.is_current_rank_in_grid():
            pgs = ProcessGroupCollection(
                tp=grid.get_pg("tp"),
                pp=grid.get_pg("pp"),
                dp=grid.get_pg("dp"),
                mp=grid.get_pg(["tp", "pp"]),
            )
            module = torch.nn.Sequential(
                *(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(4))
            ).to(device=device, dtype=dtype)
            optimizer = _get_megatron_optimizer_based_on_param_groups(
                config=config,
                model_chunks=[module],
                param_groups=[{"params": list(module.parameters())}],
                model_parallel_group=pgs.mp,
                pg_collection=pgs,
            )
            modules.append(module)
        infos[name] = ModuleOptimizerInfo(
            optimizer=optimizer, grid=grid, pg_collection=pgs, is_active=optimizer is not None
        )
    return MimoOptimizer(infos, config), modules


def _set_grads(modules: list[Any]) -> None:
    import torch

    for module in modules:
        for param in module.parameters():
            param.grad = torch.full_like(param, 1e-3)


def _measure(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from _support import count_world_collectives

    result: dict[str, Any] = {}
    for path in PATHS:
        mimo, modules = _build_mimo(path, args.backend, args.device, args.world_size, args.hidden)
        _set_grads(modules)
        with count_world_collectives() as calls:
            success, _, _ = mimo.step()
        assert success, f"{path}: the counted step did not succeed"
        times = []
        for step in range(args.warmup + args.steps):
            _set_grads(modules)
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            mimo.step()
            if args.device == "cuda":
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
            mimo.zero_grad()
        result[path] = {"collectives": calls, "times": times}
    return result


def _worker(rank: int, args: argparse.Namespace, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(args.world_size),
        RANK=str(rank),
    )
    torch.set_num_threads(1)  # the ranks share the host's cores
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count() if args.backend == "nccl" else 0)
    dist.init_process_group(
        args.backend, rank=rank, world_size=args.world_size, timeout=timedelta(seconds=300)
    )
    from _support import CudaOnCpu

    try:
        with CudaOnCpu() if args.device == "cpu" else nullcontext():
            result = _measure(rank, args)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_worker(args: argparse.Namespace) -> None:
    """Spawn the world for one tree; print per-path collectives and per-rank step times."""
    sys.path.insert(0, str(PROOFS))  # the proofs' CudaOnCpu and collective counter
    import megatron.core.models.mimo.optimizer  # noqa: F401  (import once, before forking)
    import megatron.core.optimizer  # noqa: F401
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _worker,
            args=(args, port, out_dir),
            nprocs=args.world_size,
            join=True,
            start_method="fork" if args.device == "cpu" else "spawn",
        )
        ranks = [
            json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(args.world_size)
        ]
    print(json.dumps(ranks))


# --- driver side ----------------------------------------------------------------------------


def measure_tree(tree: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    cmd = [sys.executable, __file__, "--worker", "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup), "--device", args.device, "--backend", args.backend]
    cmd += ["--world-size", str(args.world_size), "--hidden", str(args.hidden)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    if proc.returncode != 0:
        sys.exit(f"worker failed on {tree} ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(ranks: list[dict[str, Any]], path: str) -> tuple[list[int], float]:
    """World collectives per step on each rank, and the median step time of the slowest rank."""
    counts = [len(r[path]["collectives"]) for r in ranks]
    median = max(statistics.median(r[path]["times"]) for r in ranks)
    return counts, median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patched", type=Path, help="tree root with the series applied")
    parser.add_argument("--pristine", type=Path, help="tree root without it")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per path and round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=128, help="4 linears of hidden^2 / module")
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternate the trees this often; best round counts"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--world-size", type=int, choices=(1, 2), default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda")
    if args.worker:
        run_worker(args)
        return
    if args.patched is None or args.pristine is None:
        parser.error("--patched and --pristine are required")
    trees = {"unpatched": args.pristine.resolve(), "patched": args.patched.resolve()}

    runs: dict[str, list[list[dict[str, Any]]]] = {label: [] for label in trees}
    for _ in range(args.rounds):  # alternate, so that drift of the machine hits both alike
        for label, tree in trees.items():
            runs[label].append(measure_tree(tree, args))

    print(
        f"MimoOptimizer.step(): {args.world_size} {args.backend} rank(s) on {args.device}, "
        f"{args.rounds} round(s) x {args.steps} timed steps (after {args.warmup} warm-up) "
        "per tree and path; time = best round's median step time of the slowest rank"
    )
    print(f"  unpatched: {trees['unpatched']}\n  patched:   {trees['patched']}\n")
    header = f"{'path':<15}{'world coll. unp/pat':>21}{'unpatched ms':>14}"
    print(header + f"{'patched ms':>12}{'pat/unp':>9}")
    for path in PATHS:
        cells: dict[str, tuple[list[int], float]] = {}
        for label, rounds in runs.items():
            summaries = [summarize(ranks, path) for ranks in rounds]
            counts = summaries[0][0]
            assert all(s[0] == counts for s in summaries), (label, path, summaries)
            cells[label] = (counts, min(s[1] for s in summaries))
        (unp_counts, unp_time), (pat_counts, pat_time) = cells["unpatched"], cells["patched"]
        coll = f"{max(unp_counts)} / {max(pat_counts)}"
        if len(set(unp_counts + pat_counts)) > 1:
            coll += f" (per rank {unp_counts} / {pat_counts})"
        print(
            f"{path:<15}{coll:>21}{unp_time * 1e3:>14.3f}{pat_time * 1e3:>12.3f}"
            f"{pat_time / unp_time:>9.3f}"
        )


if __name__ == "__main__":
    main()
