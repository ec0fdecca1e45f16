"""Upstream's open PR #5071 as a user meets it: a finetune with ``--optimizer-cpu-offload``.

The core-API path that Megatron Bridge and NeMo-RL build (offload without the precision-aware
optimizer, which pretrain_gpt.py's own argument check would require): a small GPTModel (local
layer spec, bf16, DistributedDataParallel + distributed optimizer) is pretrained for PRETRAIN
steps without offload on a learnable synthetic task; its weights are the "checkpoint". Then, per
tree and configuration, a fresh model (another random init) with a fresh optimizer loads those
weights as a weights-only load does (``load_state_dict`` + ``optimizer.reload_model_params()``,
what megatron/training's load_checkpoint calls for ``--finetune`` / ``--no-load-optim``) and
trains FINETUNE steps. Without the fix the HybridDeviceOptimizer's fp32 masters keep the fresh
init and the first step writes them back: the loss jumps to the untrained level.

    python bench/hybrid_finetune_gpu.py --tree pristine=/path/to/tree --tree fork=/path/to/tree

Each tree is imported in its own subprocess (a world of one NCCL rank). Prints a table of the
losses per configuration; writes ``$OUT/hybrid_finetune.json`` and, with matplotlib,
``$OUT/hybrid_finetune.png`` (``OUT`` defaults to build/). It asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

PRETRAIN, FINETUNE = 150, 20

CHILD = r"""
import json, sys
import torch
import torch.distributed as dist

dist.init_process_group("nccl", rank=0, world_size=1)
torch.cuda.set_device(0)
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

parallel_state.initialize_model_parallel()
offload, pretrain, finetune = sys.argv[1] == "1", int(sys.argv[2]), int(sys.argv[3])
VOCAB, SEQ, BATCH = 128, 64, 16
config = TransformerConfig(
    num_layers=2, hidden_size=128, num_attention_heads=4, bf16=True,
    params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
)
gen = torch.Generator(device="cuda").manual_seed(0)


def batch():  # next token = (3 * token + 7) mod VOCAB: learnable, never seen as a whole
    start = torch.randint(0, VOCAB, (BATCH, 1), device="cuda", generator=gen)
    steps = torch.arange(SEQ + 1, device="cuda")
    tokens = start.expand(BATCH, SEQ + 1).clone()
    for i in range(1, SEQ + 1):
        tokens[:, i] = (3 * tokens[:, i - 1] + 7) % VOCAB
    return tokens[:, :-1], tokens[:, 1:], steps[:SEQ].expand(BATCH, SEQ)


mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, device="cuda", dtype=torch.bool), diagonal=1)


def build(seed, cpu_offload):
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ).cuda().bfloat16()
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True), model
    )
    opt = OptimizerConfig(
        optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0, use_distributed_optimizer=True,
        optimizer_cpu_offload=cpu_offload, optimizer_offload_fraction=1.0,
    )
    return ddp, get_megatron_optimizer(opt, [ddp])


def train(ddp, optimizer, n):
    losses = []
    for _ in range(n):
        tokens, labels, positions = batch()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(tokens, positions, mask, labels=labels).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        optimizer.step()
        losses.append(float(loss))
    return losses


ddp, optimizer = build(1, False)
before = train(ddp, optimizer, pretrain)
weights = {k: v.detach().clone() for k, v in ddp.module.state_dict().items() if v is not None}
ddp, optimizer = build(2, offload)
ddp.module.load_state_dict(weights, strict=False)
optimizer.reload_model_params()
tokens, labels, positions = batch()
with torch.no_grad():
    loaded = float(ddp(tokens, positions, mask, labels=labels).float().mean())
after = train(ddp, optimizer, finetune)
print(json.dumps({"pretrain": before, "loaded": loaded, "finetune": after}))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(tree: Path, offload: bool) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    args = [sys.executable, "-c", CHILD, "1" if offload else "0", str(PRETRAIN), str(FINETUNE)]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"error": last[:300]}
    return json.loads(lines[-1])


def plot(rows: list[dict], path: Path) -> None:
    """One panel per Megatron-LM tree: offload on pristine and fork against no offload."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    done = [r for r in rows if "finetune" in r]
    bases = list(dict.fromkeys(r["name"].split()[0].rsplit("-", 1)[0] for r in done))
    fig, axes = plt.subplots(1, len(bases), figsize=(6 * len(bases), 4), squeeze=False)
    steps = range(1, FINETUNE + 1)
    for ax, base in zip(axes[0], bases, strict=True):
        mine = [r for r in done if r["name"].startswith(f"{base}-")]
        for row in mine:
            side, mode = (
                row["name"].split(" ", 1)[0].rsplit("-", 1)[1],
                row["name"].split(" ", 1)[1],
            )
            if mode == "no offload":
                ax.plot(
                    steps, row["finetune"], color="k", lw=4, alpha=0.2, label=f"{side}, no offload"
                )
            else:
                color = "tab:red" if side == "pristine" else "tab:green"
                ax.plot(steps, row["finetune"], "o-", ms=3, color=color, label=f"{side}, offload")
        pre = next((r["pretrain"] for r in mine if "pretrain" in r), None)
        if pre:
            ax.axhline(pre[0], color="grey", ls=":", label="untrained (pretrain step 1)")
        said = [
            f"{r['name'].split()[0].rsplit('-', 1)[1]} with offload: {verdict(r, ref)}"
            for r in mine
            for ref in mine
            if r["name"].endswith(" offload")
            and not r["name"].endswith("no offload")
            and ref["name"] == r["name"].replace("offload", "no offload")
        ]
        ax.set_title("\n".join([base, *said]), fontsize=9)
        ax.set_xlabel("finetune step after a weights-only load")
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
    fig.suptitle("#5071: --optimizer-cpu-offload finetune from a loaded checkpoint", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def verdict(row: dict, ref: dict) -> str:
    """Whether an offload run keeps the loaded weights: its largest loss gap to no offload."""
    gap = max(abs(a - b) for a, b in zip(row["finetune"], ref["finetune"], strict=True))
    return f"{'keeps the load' if gap < 0.1 else 'LOSES the load'} ({gap:.2f})"


def verdict_title(rows: list[dict]) -> str:
    by = {r["name"]: r for r in rows if "finetune" in r}
    parts = [
        f"{name}: {verdict(row, by[name.replace('offload', 'no offload')])}"
        for name, row in by.items()
        if not name.endswith("no offload") and name.replace("offload", "no offload") in by
    ]
    return "#5071 --optimizer-cpu-offload finetune, max gap to no offload: " + "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=DIR, repeatable")
    parser.add_argument("--replot", type=Path, help="redraw the plot of a hybrid_finetune.json")
    args = parser.parse_args()
    if args.replot:
        rows = json.loads(args.replot.read_text())
        print(verdict_title(rows))
        plot(rows, args.replot.with_suffix(".png"))
        return 0
    if not args.tree:
        parser.error("--tree NAME=DIR is required (or --replot JSON)")
    rows = []
    for spec in args.tree:
        tree, _, path = spec.partition("=")
        for offload in (True, False):
            name = f"{tree} {'offload' if offload else 'no offload'}"
            result = run(Path(path).resolve(), offload)
            rows.append({"name": name, **result})
            if "error" in result:
                print(f"{name:<24} {result['error']}")
                continue
            tail = " ".join(f"{x:.2f}" for x in result["finetune"][:4])
            print(
                f"{name:<24} pretrain {result['pretrain'][0]:.2f} -> {result['pretrain'][-1]:.2f}"
                f"  loaded {result['loaded']:.2f}  finetune {tail} ... {result['finetune'][-1]:.2f}"
            )
    print(verdict_title(rows))
    out = Path(os.environ.get("OUT", "build"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid_finetune.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, out / "hybrid_finetune.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
