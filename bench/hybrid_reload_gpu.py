"""Upstream's open PR #5071 on a GPU: does a weights-only load survive the next step with
``optimizer_cpu_offload`` (HybridDeviceOptimizer inside the DistributedOptimizer)?

A finetune load (``--finetune`` / ``--no-load-optim``) writes the checkpoint's weights into the
model params and calls ``optimizer.reload_model_params()``, as megatron/training's
load_checkpoint does. Without the fix the HybridDeviceOptimizer keeps its own copies (pinned CPU
clones of offloaded params, fp32 working copies; without the precision-aware optimizer also the
DistributedOptimizer's fp32 shard masters) at their pre-load values, and the first step writes
them back over the loaded weights: training goes on from the random initialization.

Per tree (each imported in its own subprocess, a world of one NCCL rank) and configuration
(offload fraction 0.5 / 1.0, precision-aware optimizer off / on): DistributedDataParallel and
get_megatron_optimizer (adam, bf16) over a bf16 Linear -> Linear model, one step on seeded
grads, then the "load": every param set to new values, ``reload_model_params()``, then one step
with zero grads and lr 0. The weights must still be the loaded ones (max |param - loaded|).

    python bench/hybrid_reload_gpu.py --tree pristine=/path/to/tree --tree pr5071=/path/to/tree

A table goes to stdout and ``$OUT/hybrid_reload.json`` (``OUT`` defaults to build/).
Only the stdlib and torch are needed (plus what the trees' ``megatron.core`` imports).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

CONFIGS = [(0.5, False), (1.0, False), (0.5, True), (1.0, True)]

CHILD = r"""
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("nccl", rank=0, world_size=1)
torch.cuda.set_device(0)
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig

parallel_state.initialize_model_parallel()
fraction, precision_aware = float(sys.argv[1]), sys.argv[2] == "1"
torch.manual_seed(5071)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
model = model.cuda().to(torch.bfloat16)
ddp = DistributedDataParallel(
    TransformerConfig(num_attention_heads=1, num_layers=1),
    DistributedDataParallelConfig(use_distributed_optimizer=True),
    model,
)
extra = {}
if precision_aware:
    extra = dict(
        use_precision_aware_optimizer=True,
        main_params_dtype=torch.float32,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
    )
config = OptimizerConfig(
    optimizer="adam", lr=1e-3, bf16=True, clip_grad=0.0, use_distributed_optimizer=True,
    optimizer_cpu_offload=True, optimizer_offload_fraction=fraction, **extra,
)
optimizer = get_megatron_optimizer(config, [ddp])
params = list(ddp.module.parameters())
for p in params:
    p.main_grad.copy_(torch.randn_like(p.main_grad))
optimizer.step()
with torch.no_grad():  # the weights-only load
    for p in params:
        p.copy_(torch.randn_like(p))
loaded = [p.detach().clone() for p in params]
optimizer.reload_model_params()
for group in optimizer.param_groups:
    group["lr"] = 0.0
for p in params:
    p.main_grad.zero_()
optimizer.step()
torch.cuda.synchronize()
deviation = max(float((p.float() - w.float()).abs().max()) for p, w in zip(params, loaded))
print(json.dumps({"deviation": deviation}))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(tree: Path, fraction: float, precision_aware: bool) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    args = [sys.executable, "-c", CHILD, str(fraction), "1" if precision_aware else "0"]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"error": last[:200]}
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="NAME=DIR, repeatable")
    args = parser.parse_args()
    rows = []
    for spec in args.tree:
        name, _, path = spec.partition("=")
        for fraction, precision_aware in CONFIGS:
            result = run(Path(path).resolve(), fraction, precision_aware)
            kept = "error" not in result and result["deviation"] < 1e-2
            verdict = result.get("error") or ("loaded weights kept" if kept else "REVERTED")
            rows.append(
                {
                    "tree": name,
                    "offload_fraction": fraction,
                    "precision_aware": precision_aware,
                    **result,
                    "verdict": verdict,
                }
            )
            dev = f"{result['deviation']:.4f}" if "deviation" in result else "-"
            print(
                f"{name:<12} fraction {fraction:<4} precision-aware {precision_aware!s:<5} "
                f"max |param - loaded| {dev:<8} {verdict}"
            )
    out = Path(os.environ.get("OUT", "build"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid_reload.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
