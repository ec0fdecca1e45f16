"""Host syncs and all-reduces per optimizer step: ChainedOptimizer and MimoOptimizer, per tree.

Counts, per rank and step, what the loss-scaler fixes could add to the step path: calls that
block the host on a CUDA device (device-to-host reads: ``Tensor.item``, ``.tolist()``,
``bool()``, ``float()``, ``int()``, ``.cpu()``; blocking host-to-device copies:
``torch.tensor(..., device='cuda')``, ``.cuda()``, ``.to('cuda')``) and
``torch.distributed.all_reduce`` calls (all groups; in brackets those on the world group).

    python bench/bench_step_counts.py --tree pristine=/tmp/main-pristine \
        --tree series=build/trees/main

Each tree root holds ``megatron/core``; the first ``--tree`` is the reference. Each tree runs in
its own subprocess (the two ``megatron.core`` imports never mix), which forks a world of 2 gloo
ranks on the host and steps real optimizers there:

- ``chained``: a ChainedOptimizer of a dense and an expert Float16OptimizerWithFloat16Params,
  each with its own grad scaler (as ``get_megatron_optimizer`` builds them for FP16 + MoE),
  clip_grad 1.0; ``overflow``: inf in the expert grads on every rank;
- ``mimo``: a MimoOptimizer with the encoder grid on rank 0 and the LLM grid on rank 1 (each
  rank one dynamic scaler; ``colocated``: both grids on rank 0, two scalers there, and rank 1
  holds no module: a stub optimizer), inner optimizers from MCore's optimizer builder,
  clip_grad 1.0; ``overflow``: inf in the encoder's grads (rank 0 only).

Measurement only, not the code under test: a TorchFunctionMode counts the calls, and the
proofs' disclosed ``CudaOnCpu`` mode places MCore's ``device='cuda'`` tensors on the host. Every
tensor stands for a CUDA one, so the counts are an upper bound of the syncs on a GPU (a read of
a tensor that lives on the host there counts too); the comparison between trees is exact.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PROOFS = Path(__file__).resolve().parents[1] / "tests" / "proofs"
WORLD_SIZE = 2
SCENARIOS = (
    "chained fp16 dynamic",
    "chained fp16 dynamic, overflow",
    "chained fp16 constant",
    "chained bf16",
    "mimo fp16 dynamic",
    "mimo fp16 dynamic, overflow",
    "mimo fp16 dynamic, colocated",
    "mimo fp16 constant",
    "mimo bf16",
)


# --- worker side (runs with one tree on PYTHONPATH) -----------------------------------------


def _precision(name: str) -> dict[str, Any]:
    if "bf16" in name:
        return {"bf16": True}
    if "constant" in name:
        return {"fp16": True, "loss_scale": 1024.0}
    return {"fp16": True, "initial_loss_scale": 1024.0, "hysteresis": 2}


def _chained(name: str) -> tuple[Any, list[Any]]:
    """Dense and expert optimizers, each with its own grad scaler, in a ChainedOptimizer."""
    import torch
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
    from megatron.core.optimizer.optimizer import (
        ChainedOptimizer,
        Float16OptimizerWithFloat16Params,
    )

    config = OptimizerConfig(optimizer="sgd", lr=0.01, clip_grad=1.0, **_precision(name))
    dtype = torch.bfloat16 if config.bf16 else torch.float16
    parts, params = [], []
    for _ in ("dense", "expert"):
        if config.bf16:
            scaler = None
        elif config.loss_scale:
            scaler = ConstantGradScaler(config.loss_scale)
        else:
            scaler = DynamicGradScaler(1024.0, 1.0, 2.0, 0.5, 1000, 2)
        param = torch.nn.Parameter(torch.zeros(64, dtype=dtype))
        sgd = torch.optim.SGD([param], lr=0.01)
        parts.append(Float16OptimizerWithFloat16Params(sgd, config, scaler, lambda *a: None))
        params.append(param)
    return ChainedOptimizer(parts), params


def _mimo(name: str) -> tuple[Any, list[Any]]:
    """bench_mimo's MimoOptimizer: encoder grid on rank 0, LLM grid on the last rank (or 0)."""
    from bench_mimo import _build_mimo

    path = "bf16" if "bf16" in name else "fp16_constant" if "constant" in name else "fp16_dynamic"
    llm_rank = 0 if "colocated" in name else WORLD_SIZE - 1
    mimo, modules = _build_mimo(path, "gloo", "cpu", WORLD_SIZE, hidden=8, llm_rank=llm_rank)
    return mimo, [param for module in modules for param in module.parameters()]


def _measure(rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from _support import CountHostSyncs

    result: dict[str, Any] = {}
    for name in SCENARIOS:
        optimizer, params = (_chained if name.startswith("chained") else _mimo)(name)
        overflow = name.endswith("overflow")
        # Which params get inf: the expert's (the chain's last) on every rank; the encoder's
        # (rank 0's) in MIMO.
        inf_params = params[-1:] if name.startswith("chained") else params[:1] if rank == 0 else []
        for step in range(2):  # a warm-up step, then the counted one
            for param in params:
                bad = overflow and step == 1 and any(param is p for p in inf_params)
                param.grad = torch.full_like(param, float("inf") if bad else 1e-3)
            all_reduces: list[bool] = []
            original = dist.all_reduce

            def counting(*args, original=original, calls=all_reduces, **kwargs):
                group = kwargs.get("group", args[2] if len(args) > 2 else None)
                calls.append(group is None or group is dist.group.WORLD)
                return original(*args, **kwargs)

            dist.all_reduce = counting
            try:
                with CountHostSyncs() as syncs:
                    success = optimizer.step()[0]
            finally:
                dist.all_reduce = original
        assert success is not overflow, f"{name}: step success {success}"
        result[name] = {
            "syncs": syncs.calls,
            "all_reduce": len(all_reduces),
            "world": sum(all_reduces),
        }
    return result


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    from _support import CudaOnCpu
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()  # the chained optimizers' grad-stats group

    try:
        with CudaOnCpu():
            result = _measure(rank)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_worker() -> None:
    """Fork the world for the tree on PYTHONPATH; print each rank's counts as JSON."""
    sys.path.insert(0, str(PROOFS))
    import megatron.core.models.mimo.optimizer  # noqa: F401  (import once, before forking)
    import megatron.core.optimizer  # noqa: F401
    import torch.multiprocessing as mp
    from _support import free_port

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _rank_main, args=(free_port(), out_dir), nprocs=WORLD_SIZE, start_method="fork"
        )
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(2)]
    print(json.dumps(ranks))


# --- driver side ----------------------------------------------------------------------------


def measure_tree(tree: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, __file__, "--worker"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    if proc.returncode != 0:
        sys.exit(f"worker failed on {tree} ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cell(ranks: list[dict[str, Any]], name: str) -> str:
    """'syncs / all-reduces (world)', per rank where the ranks differ."""
    per_rank = [
        f"{len(r[name]['syncs'])} / {r[name]['all_reduce']} ({r[name]['world']})" for r in ranks
    ]
    if len(set(per_rank)) == 1:
        return per_rank[0]
    return "; ".join(f"rank {r}: {c}" for r, c in enumerate(per_rank))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tree", action="append", default=[], metavar="LABEL=PATH", help="repeatable"
    )
    parser.add_argument("--json", type=Path, help="also write the raw per-rank calls here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker()
        return
    trees = dict(t.split("=", 1) for t in args.tree if "=" in t)
    if len(trees) < 2 or len(trees) != len(args.tree):
        parser.error("give at least two --tree LABEL=PATH")
    results = {label: measure_tree(Path(path).resolve()) for label, path in trees.items()}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(
        f"Per optimizer step() on each of {WORLD_SIZE} gloo ranks (CPU, CudaOnCpu): host syncs / "
        "all-reduces (of them on the world group), per rank where the ranks differ"
    )
    for label, path in trees.items():
        print(f"  {label}: {path}")
    labels = list(trees)
    rows = [["step", *labels]] + [
        [name, *(cell(results[label], name) for label in labels)] for name in SCENARIOS
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print()
    for index, row in enumerate(rows):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if index == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print("\nHost syncs by kind (rank 0 / rank 1):")
    for name in SCENARIOS:
        kinds = []
        for label in labels:
            per_rank = [",".join(sorted(r[name]["syncs"])) or "-" for r in results[label]]
            kinds.append(f"{label}: {' / '.join(per_rank)}")
        print(f"  {name}: " + "; ".join(kinds))


if __name__ == "__main__":
    main()
