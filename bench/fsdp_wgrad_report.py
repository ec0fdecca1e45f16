"""Verdicts and a plot from the runs of bench/fsdp_wgrad_gpu.sh (Megatron-FSDP fused wgrad).

    python bench/fsdp_wgrad_report.py RUNS_DIR OUT --trees "core_v0.19.0 main" [--name N]
        [--note "tied embedding and output weights"]

RUNS_DIR holds NAME.log and NAME.rc per run, NAME = TREE-SIDE-PARALLELISM-{fused,unfused}
(SIDE pristine or fork; PARALLELISM optim, no_shard or ddp). A run's loss curve with gradient
accumulation fusion is compared with the same run without it (the reference): the largest loss
gap over the run, next to the same gap under DDP, the yardstick of what fusion alone changes.
Prints the table (markdown) and writes OUT/N.md; with matplotlib, OUT/N.png (N: fsdp-wgrad)
(per Megatron-LM tree and strategy, the fused runs' loss against the unfused reference, each
title carrying its verdicts). It asserts nothing.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

STEP = re.compile(r"iteration\s+(\d+)/.*?lm loss: ([0-9.eE+-]+).*?grad norm: ([0-9.eE+-]+)")
STRATEGIES = ("optim", "no_shard")
Curve = dict[int, tuple[float, float]]  # step -> (loss, grad norm)


def curve(runs: Path, name: str) -> Curve | None:
    """The run's steps, or None where it failed or left no log."""
    log, rc = runs / f"{name}.log", runs / f"{name}.rc"
    if not log.exists() or not rc.exists() or rc.read_text().strip() != "0":
        return None
    found = STEP.findall(log.read_text(errors="replace"))
    return {int(i): (float(loss), float(norm)) for i, loss, norm in found} or None


def gap(runs: Path, name: str) -> tuple[float, float, float] | None:
    """Max loss gap fused vs unfused, and both step-1 grad norms."""
    fused, unfused = curve(runs, f"{name}-fused"), curve(runs, f"{name}-unfused")
    if not fused or not unfused or fused.keys() != unfused.keys():
        return None
    loss = max(abs(fused[i][0] - unfused[i][0]) for i in fused)
    return loss, fused[min(fused)][1], unfused[min(unfused)][1]


def bound(runs: Path, tree: str) -> float | None:
    """The largest gap a run that keeps every microbatch may show: 2x DDP's, at least 0.02."""
    yard = gap(runs, f"{tree}-pristine-ddp")
    return max(2 * yard[0], 0.02) if yard else None


def verdict(runs: Path, tree: str, side: str, strategy: str) -> str:
    g, limit = gap(runs, f"{tree}-{side}-{strategy}"), bound(runs, tree)
    if g is None or limit is None:
        return "no result"
    return "keeps every microbatch" if g[0] <= limit else "drops microbatches"


def table(runs: Path, trees: list[str]) -> str:
    lines = [
        "| tree | Megatron-LM | parallelism | max loss gap, fused vs unfused "
        "| step-1 grad norm fused / unfused | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for tree in trees:
        rows = [("pristine", "ddp")] + [(s, x) for s in ("pristine", "fork") for x in STRATEGIES]
        for side, strategy in rows:
            g = gap(runs, f"{tree}-{side}-{strategy}")
            label = "DDP (yardstick)" if strategy == "ddp" else f"Megatron-FSDP {strategy}"
            if g is None:
                lines.append(f"| {side} | {tree} | {label} | run failed | | see logs/ |")
                continue
            said = "yardstick" if strategy == "ddp" else verdict(runs, tree, side, strategy)
            lines.append(
                f"| {side} | {tree} | {label} | {g[0]:.3f} | {g[1]:.3f} / {g[2]:.3f} | {said} |"
            )
    lines += [
        "",
        "A run keeps every microbatch where its gap stays within 2x the DDP yardstick's "
        "(at least 0.02).",
    ]
    return "\n".join(lines) + "\n"


def plot(runs: Path, trees: list[str], out: Path, name: str = "fsdp-wgrad", note: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(trees), len(STRATEGIES), figsize=(6 * len(STRATEGIES), 3.8 * len(trees)), squeeze=False
    )
    for row, tree in enumerate(trees):
        for col, strategy in enumerate(STRATEGIES):
            ax = axes[row][col]
            styles = {
                "pristine": ("tab:red", "pristine, fused"),
                "fork": ("tab:green", "fork, fused"),
            }
            ref = curve(runs, f"{tree}-fork-{strategy}-unfused") or curve(
                runs, f"{tree}-pristine-{strategy}-unfused"
            )
            if ref:
                steps = sorted(ref)
                ax.plot(
                    steps,
                    [ref[i][0] for i in steps],
                    "k-",
                    lw=3,
                    alpha=0.3,
                    label="unfused (reference)",
                )
            for side, (color, label) in styles.items():
                c = curve(runs, f"{tree}-{side}-{strategy}-fused")
                if c:
                    steps = sorted(c)
                    ax.plot(steps, [c[i][0] for i in steps], "o-", color=color, ms=3, label=label)
            said = ", ".join(f"{s}: {verdict(runs, tree, s, strategy)}" for s in styles)
            ax.set_title(f"{tree}, Megatron-FSDP {strategy}\n{said}", fontsize=9)
            ax.set_xlabel("iteration")
            ax.set_ylabel("lm loss")
            ax.legend(fontsize=8)
    fig.suptitle(
        "Gradient accumulation fusion under Megatron-FSDP: fused vs unfused loss"
        + (f" ({note})" if note else ""),
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--trees", default="core_v0.19.0 main")
    parser.add_argument("--name", default="fsdp-wgrad", help="OUT/NAME.md, OUT/NAME.png")
    parser.add_argument("--note", default="", help="added to the plot's title")
    args = parser.parse_args()
    trees = args.trees.split()
    text = table(args.runs, trees)
    print(text, end="")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    try:
        plot(args.runs, trees, args.out, args.name, args.note)
    except ImportError:
        print("no matplotlib: no plot")


if __name__ == "__main__":
    main()
