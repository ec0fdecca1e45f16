"""Verdicts and plots from the runs of bench/e2e_gpu.sh (pristine vs fork, per scenario).

    python bench/e2e_report.py RUNS_DIR OUT [--inject K] [--save N] [--tolerance T]

RUNS_DIR holds NAME.jsonl (bench/e2e_hook.py's step records), NAME.log and NAME.rc per run.
Prints the verdict table (markdown) and writes OUT/e2e-verdicts.md; with matplotlib, also
OUT/e2e-scaler.png, OUT/e2e-resume.png, OUT/e2e-fsdp.png and (scenario 4) OUT/e2e-5077.png,
each title carrying its verdicts. It states what it measured;
it asserts nothing. Verdicts: "bug shown" (pristine shows the bug the scenario targets), "ok"
(the expected healthy behaviour), "WRONG" (a fork or control row that is not healthy), "NO
RESULT" (the run could not measure it), "NOT CONVERTED" (a pristine-written checkpoint resumed
on the fork with other params' state), "NOT EXERCISED" (the fork without distopt-index-layout
resumed that checkpoint exactly too: the conversion was not needed).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

Steps = dict[int, dict[str, Any]]


class Runs:
    """The records of one RUNS_DIR."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def steps(self, name: str) -> Steps:
        path = self.root / f"{name}.jsonl"
        if not path.exists():
            return {}
        records = [json.loads(line) for line in path.read_text().splitlines() if line]
        return {r["step"]: r for r in records if "step" in r}

    def rc(self, name: str) -> int | None:
        path = self.root / f"{name}.rc"
        return int(path.read_text()) if path.exists() else None

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def failure(self, name: str) -> str:
        """The run's exit status and its last error line, or '' when it finished."""
        rc = self.rc(name)
        if rc == 0:
            return ""
        errors = [
            line.strip()
            for line in self.log(name).splitlines()
            if re.search(r"Error|Segmentation fault|signal|Traceback", line)
        ]
        what = errors[-1][:160] if errors else "no error line"
        return f"exit {rc}: {what}"


def equal_steps(a: Steps, b: Steps, steps: list[int]) -> tuple[int, int | None]:
    """How many of steps have bitwise-equal losses in a and b, and the first that differs."""
    same, first = 0, None
    for s in steps:
        if s in a and s in b and a[s]["loss_hex"] == b[s]["loss_hex"]:
            same += 1
        elif first is None:
            first = s
    return same, first


def scaler_split(steps: Steps) -> int | None:
    """First step after which the chained optimizers' scalers hold different states."""
    for s in sorted(steps):
        states = [tuple(sorted(c.items())) for c in steps[s]["scalers"]]
        if len(set(states)) > 1:
            return s
    return None


def scenario1(runs: Runs, inject: int) -> list[list[str]]:
    rows = []
    p, f = runs.steps("s1-pristine"), runs.steps("s1-fork")
    same, first = equal_steps(p, f, list(range(1, inject)))
    _, after = equal_steps(p, f, sorted(s for s in p if s >= inject))
    for tree, steps in (("pristine", p), ("fork", f)):
        fail = runs.failure(f"s1-{tree}")
        if fail or not steps:
            rows.append(["1 fp16+MoE chain scalers", tree, "NO RESULT", fail or "no steps"])
            continue
        chains = len(steps[min(steps)]["scalers"])
        split = scaler_split(steps)
        skipped = [s for s in sorted(steps) if steps[s]["skipped"]]
        last = steps[max(steps)]["scalers"]
        scales = "/".join(f"{c['scale']:g}" for c in last)
        what = (
            f"{chains} chains; skipped steps {skipped}; "
            + (f"scalers DIVERGE from step {split}" if split else "scalers equal at every step")
            + f"; final scales {scales}"
        )
        verdict = ("bug shown" if tree == "pristine" else "WRONG") if split else "ok"
        rows.append(["1 fp16+MoE chain scalers", tree, verdict, what])
    rows.append(
        [
            "1 fp16+MoE chain scalers",
            "pristine vs fork",
            "ok" if same == inject - 1 else "DIFFER BEFORE INJECTION",
            f"losses of steps 1..{inject - 1} bitwise equal: {same}/{inject - 1}"
            + (f" (first difference: step {first})" if first else "")
            + (f"; losses differ from step {after} on" if after else "; equal after it too"),
        ]
    )
    return rows


def resume_exactness(runs: Runs, uninterrupted: str, resumed: str, save: int) -> str:
    fail = runs.failure(resumed)
    if fail:
        return f"resume failed ({fail})"
    a, b = runs.steps(uninterrupted), runs.steps(resumed)
    later = sorted(s for s in a if s > save)
    if not later or not b:
        return "no steps to compare"
    same, first = equal_steps(a, b, later)
    worst = max(abs(a[s]["loss"] - b[s]["loss"]) for s in later if s in b)
    verdict = "EXACT" if same == len(later) else "DIFFERS"
    return (
        f"{verdict}: steps {later[0]}..{later[-1]} bitwise equal to uninterrupted "
        f"{same}/{len(later)}"
        + (f", first difference step {first}, max |dloss| {worst:.3g}" if first else "")
    )


def saved_and_resumed(runs: Runs, name: str, save: int) -> str:
    """Whether run NAME saved at step save, and how its resume NAME-resumed compares."""
    fail = runs.failure(name)
    if fail:
        return f"save at step {save} FAILS ({fail})"
    return resume_exactness(runs, name, f"{name}-resumed", save)


def scenario2(runs: Runs, save: int) -> list[list[str]]:
    rows = []
    for fmt, label in (("dp", "dp_reshardable"), ("full", "fully_reshardable")):
        for tree in ("pristine", "fork"):
            name = f"s2a-{fmt}-{tree}"
            what = saved_and_resumed(runs, name, save)
            exact = what.startswith("EXACT")
            verdict = "ok" if exact else ("bug shown" if tree == "pristine" else "WRONG")
            rows.append([f"2A MoE, fp32 routers, {label}", tree, verdict, what])
    for fmt, label in (("dp", "dp_reshardable"), ("full", "fully_reshardable")):
        scenario = f"2B fp32 final norm, equal sizes, {label}"
        for tree in ("pristine", "fork"):
            name = f"s2b-{fmt}-{tree}"
            what = saved_and_resumed(runs, name, save)
            if what.startswith("EXACT"):
                verdict = "ok"
            elif tree == "fork":
                verdict = "WRONG"
            else:  # pristine's own save or resume fails: e.g. the in-place load of bug 2
                verdict = "bug shown" if "FAIL" in what or "failed" in what else "NO RESULT"
            rows.append([scenario, tree, verdict, what])
        name = f"s2b-{fmt}-fork-from-pristine"
        if runs.rc(name) is None:
            continue
        what = resume_exactness(runs, f"s2b-{fmt}-pristine", name, save)
        warned = [
            line.strip()
            for line in runs.log(name).splitlines()
            if line.startswith("WARNING:megatron.core.optimizer")
        ]
        if warned:
            what += f"; {len(warned)} optimizer warning(s): {warned[0][:240]}"
        verdict = {"EXACT": "ok", "DIFFERS": "NOT CONVERTED"}.get(what.split(":")[0], "NO RESULT")
        rows.append([f"2B pristine-written {label} checkpoint", "resumed on fork", verdict, what])
        name = f"s2b-{fmt}-noconv-from-pristine"
        if runs.rc(name) is not None:
            what = resume_exactness(runs, f"s2b-{fmt}-pristine", name, save)
            verdict = {"EXACT": "NOT EXERCISED", "DIFFERS": "bug shown"}.get(
                what.split(":")[0], "NO RESULT"
            )
            tree = "resumed on fork without distopt-index-layout"
            rows.append([f"2B pristine-written {label} checkpoint", tree, verdict, what])
        # back to upstream: the fork's checkpoint on pristine, exact or refused, never permuted
        name = f"s2b-{fmt}-pristine-from-fork"
        if runs.rc(name) is not None:
            fail = runs.failure(name)
            what = fail or resume_exactness(runs, f"s2b-{fmt}-fork", name, save)
            verdict = "refused" if fail else "ok" if what.startswith("EXACT") else "WRONG"
            tree = "resumed on pristine"
            rows.append([f"2B fork-written {label} checkpoint", tree, verdict, what])
    for tree in ("pristine", "fork"):
        name = f"s2c-dp-{tree}"
        fail = runs.failure(name)
        what = fail or resume_exactness(runs, name, f"{name}-resumed", save)
        verdict = "ok" if what.startswith("EXACT") else "WRONG"
        rows.append(["2C control (no fp32 params), dp_reshardable", tree, verdict, what])
    return rows


def scenario3(runs: Runs, tolerance: float) -> list[list[str]]:
    rows = []
    ref = runs.steps("s3-ddp-fork")
    for tree in ("pristine", "fork"):
        name = f"s3-fsdp-{tree}"
        steps = runs.steps(name)
        fail = runs.failure(name)
        parts = [fail] if fail else []
        trains = close = False
        if steps:
            first, last = steps[min(steps)], steps[max(steps)]
            norms = [steps[s]["grad_norm"] or 0.0 for s in sorted(steps)]
            trains = max(norms) > 0 and last["loss"] < first["loss"] - 0.5
            parts.append(
                f"{len(steps)} steps, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
                f"max grad norm {max(norms):.3g}"
            )
            common = [s for s in steps if s in ref]
            if common:
                rel = max(
                    abs(steps[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in common
                )
                close = rel <= tolerance
                within = "within" if close else "OUTSIDE"
                parts.append(
                    f"max relative loss difference vs DDP {rel:.2e} ({within} {tolerance:g})"
                )
        else:
            parts.append("no training step logged")
        if trains and close and not fail:
            verdict = "ok"
        else:
            verdict = "bug shown" if tree == "pristine" else "WRONG"
        label = "3 Megatron-FSDP + precision-aware FusedAdam, flag default"
        rows.append([label, tree, verdict, "; ".join(parts)])
    fail = runs.failure("s3-ddp-fork")
    if ref:
        first, last = ref[min(ref)], ref[max(ref)]
        rows.append(
            [
                "3 reference: DDP + distributed optimizer",
                "fork",
                "WRONG" if fail else "reference",
                fail or f"{len(ref)} steps, loss {first['loss']:.4f} -> {last['loss']:.4f}",
            ]
        )
    return rows


S4 = "4 #5077 padded buckets, fully_reshardable, core_v0.19.0"


def scenario4(runs: Runs, save: int) -> list[list[str]]:
    rows = []
    for tree in ("pristine", "fork"):
        name = f"s4-rel-{tree}"
        if runs.rc(name) is None:
            continue
        what = saved_and_resumed(runs, name, save)
        verdict = (
            "ok" if what.startswith("EXACT") else "bug shown" if tree == "pristine" else "WRONG"
        )
        rows.append([S4, tree, verdict, what])
    return rows


def said(rows: list[list[str]], *scenarios: str) -> str:
    """The verdicts of these scenarios' rows, for a plot title: 'pristine: bug shown, fork: ok'."""
    return ", ".join(f"{tree}: {verdict}" for sc, tree, verdict, _ in rows if sc in scenarios)


# Curves that coincide (a resume bitwise equal to the uninterrupted run) stay visible: a wide
# pale line under dashed and dotted ones with hollow markers of other shapes and sizes.
STYLES: list[dict[str, Any]] = [
    {"ls": "-", "lw": 6, "alpha": 0.3},
    {"ls": "--", "lw": 1.6, "marker": "o", "ms": 8, "mfc": "none"},
    {"ls": ":", "lw": 1.8, "marker": "s", "ms": 5, "mfc": "none"},
    {"ls": "-.", "lw": 1.3, "marker": "^", "ms": 4},
]
COLORS = {"pristine": "tab:blue", "fork": "tab:orange", "noconv": "tab:red", "ddp": "tab:green"}


def plots(runs: Runs, out: Path, inject: int, save: int, rows: list[list[str]]) -> None:
    """e2e-scaler.png, e2e-resume.png, e2e-fsdp.png and e2e-5077.png: one panel per question,
    its verdicts in its title, a legend in words, a red X (with the error) where a run failed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    def curve(name: str, key: str = "loss") -> tuple[list[int], list[float]]:
        steps = runs.steps(name)
        xs = sorted(s for s in steps if steps[s].get(key) is not None)
        return xs, [steps[s][key] for s in xs]

    def frame(ax: Any, title: str, ylabel: str) -> None:
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True, steps=[1, 2, 5, 10]))
        ax.grid(alpha=0.3)

    def mark(ax: Any, x: int, text: str) -> None:
        ax.axvline(x, color="grey", lw=0.8, ls=":")
        ax.annotate(
            text,
            (x, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12),
            textcoords="offset points",
            fontsize=7,
            color="dimgrey",
        )

    def failed(ax: Any, name: str, what: str, where: tuple[float, float] | None) -> None:
        """A red X where run NAME failed: its last step, else `where`; the error beside it."""
        if runs.rc(name) in (None, 0):
            return
        xs, ys = curve(name)
        x, y = (xs[-1], ys[-1]) if xs else where or (None, None)
        if x is None:
            return
        error = re.search(r"\b(\w+(?:Error|Exception))\b", runs.failure(name))
        ax.plot([x], [y], "X", color="crimson", ms=14, mec="black", zorder=5)
        ax.annotate(
            f"{what}\n({error.group(1) if error else f'exit {runs.rc(name)}'})",
            (x, y),
            xytext=(12, 14),
            textcoords="offset points",
            fontsize=8,
            color="crimson",
        )

    def panel(ax: Any, title: str, lines: list[tuple[str, str]], key: str = "loss") -> None:
        """The runs `lines` (name, legend) in one panel; a failed one ends in a red X."""
        base_x, base_y = curve(lines[0][0], key)
        at_save = dict(zip(base_x, base_y, strict=True)).get(save)
        for i, (name, label) in enumerate(lines):
            tree = "noconv" if "noconv" in name else "ddp" if "ddp" in name else "fork"
            if "pristine" in name and "from-pristine" not in name:
                tree = "pristine"
            ax.plot(*curve(name, key), color=COLORS[tree], label=label, **STYLES[i % len(STYLES)])
            resume = name.endswith(("-resumed", "-from-pristine"))
            what = "resume fails" if resume else f"save at {save} fails"
            failed(ax, name, f"{label.split(',')[0]}: {what}", (save, at_save) if at_save else None)
        frame(ax, title, {"loss": "lm loss", "grad_norm": "grad norm"}[key])
        ax.legend(fontsize=8, loc="lower left" if key == "loss" else "best")  # loss falls

    def finish(fig: Any, title: str, name: str) -> None:
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)

    # 1: each chain's loss scale, pristine and fork, and the loss
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, tree in zip(axes, ("pristine", "fork"), strict=False):
        steps = runs.steps(f"s1-{tree}")
        xs = sorted(steps)
        for c, chain in enumerate(("dense", "expert")):
            ys = [
                steps[s]["scalers"][c]["scale"] if len(steps[s]["scalers"]) > c else None
                for s in xs
            ]
            ax.plot(xs, ys, color=COLORS[tree], label=f"{tree}, {chain} chain", **STYLES[c])
        if any(line.get_ydata().size for line in ax.get_lines()):
            ax.set_yscale("log", base=2)
        frame(ax, f"{tree.capitalize()}: loss scale of each optimizer chain", "loss scale")
        ax.legend(fontsize=8, loc="upper left")
    axes[1].sharey(axes[0])
    panel(axes[2], "Training loss", [("s1-pristine", "pristine"), ("s1-fork", "fork")])
    for ax in axes:
        mark(ax, inject, f" inf in one expert grad: step {inject} skipped")
    finish(
        fig,
        f"Scenario 1: FP16 + MoE, an overflow in the expert chain only at iteration {inject}\n"
        + said(rows, "1 fp16+MoE chain scalers"),
        "e2e-scaler.png",
    )

    # 2: resumed from the checkpoint of iteration `save` vs uninterrupted
    def pristine_written(fmt: str) -> list[tuple[str, str]]:
        return [
            (f"s2b-{fmt}-pristine", "pristine, uninterrupted"),
            (f"s2b-{fmt}-pristine-resumed", "pristine, resumed"),
            (f"s2b-{fmt}-fork-from-pristine", "fork, resumed"),
            (f"s2b-{fmt}-noconv-from-pristine", "fork without conversion, resumed"),
        ]

    def routers(fmt: str) -> list[tuple[str, str]]:
        return [
            (f"s2a-{fmt}-fork", "fork, uninterrupted"),
            (f"s2a-{fmt}-fork-resumed", "fork, resumed"),
            (f"s2a-{fmt}-pristine", "pristine"),
        ]

    panels = [
        (
            "2A MoE, fp32 routers: dp_reshardable",
            routers("dp"),
            "2A MoE, fp32 routers, dp_reshardable",
        ),
        (
            "2A MoE, fp32 routers: fully_reshardable",
            routers("full"),
            "2A MoE, fp32 routers, fully_reshardable",
        ),
        (
            "2C control, no fp32 params: dp_reshardable",
            [
                ("s2c-dp-pristine", "pristine, uninterrupted"),
                ("s2c-dp-pristine-resumed", "pristine, resumed"),
                ("s2c-dp-fork-resumed", "fork, resumed"),
            ],
            "2C control (no fp32 params), dp_reshardable",
        ),
        (
            "2B pristine's dp_reshardable checkpoint",
            pristine_written("dp"),
            "2B pristine-written dp_reshardable checkpoint",
        ),
        (
            "2B pristine's fully_reshardable checkpoint",
            pristine_written("full"),
            "2B pristine-written fully_reshardable checkpoint",
        ),
        (
            "2B the fork's own checkpoints",
            [
                ("s2b-dp-fork", "fork, uninterrupted"),
                ("s2b-dp-fork-resumed", "fork, resumed (dp_reshardable)"),
                ("s2b-full-fork-resumed", "fork, resumed (fully_reshardable)"),
            ],
            "2B fp32 final norm, equal sizes, dp_reshardable",
        ),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(16, 9.5))
    for ax, (title, lines, scenario) in zip(axes.flat, panels, strict=True):
        verdicts = [(t, v) for sc, t, v, _ in rows if sc == scenario]
        if scenario.endswith("checkpoint"):  # pristine-written: the resume on the fork decides
            verdicts = [(t.replace("resumed on ", ""), v) for t, v in verdicts]
        panel(ax, title + "\n" + ", ".join(f"{t}: {v}" for t, v in verdicts), lines)
        mark(ax, save, f" checkpoint of iteration {save}")
    finish(
        fig,
        f"Scenario 2: fp32 params in 16-bit groups, resumed from the checkpoint of "
        f"iteration {save}: exact where it lies on the uninterrupted run",
        "e2e-resume.png",
    )

    # 3: Megatron-FSDP with the precision-aware optimizer vs DDP
    lines = [
        ("s3-ddp-fork", "DDP + distributed optimizer (reference)"),
        ("s3-fsdp-fork", "Megatron-FSDP, fork"),
        ("s3-fsdp-pristine", "Megatron-FSDP, pristine"),
    ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    panel(ax1, "Training loss", lines)
    panel(ax2, "Grad norm", lines, key="grad_norm")
    finish(
        fig,
        "Scenario 3: Megatron-FSDP + precision-aware FusedAdam, "
        "megatron_fsdp_use_decoupled_grad left at its default\n"
        + said(rows, "3 Megatron-FSDP + precision-aware FusedAdam, flag default"),
        "e2e-fsdp.png",
    )

    # 4: #5077 on the release: resumed from a fully_reshardable checkpoint with padded buckets
    if runs.rc("s4-rel-pristine") is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    lines = [
        ("s4-rel-pristine", "pristine 0.19.0, uninterrupted"),
        ("s4-rel-pristine-resumed", "pristine 0.19.0, resumed"),
        ("s4-rel-fork", "fork of 0.19.0, uninterrupted"),
        ("s4-rel-fork-resumed", "fork of 0.19.0, resumed"),
    ]
    panel(ax1, "Training loss", lines)
    mark(ax1, save, f" checkpoint of iteration {save}")
    for i, tree in enumerate(("pristine", "fork")):
        a, b = runs.steps(f"s4-rel-{tree}"), runs.steps(f"s4-rel-{tree}-resumed")
        xs = sorted(x for x in b if x in a)
        ax2.plot(
            xs,
            [abs(b[x]["loss"] - a[x]["loss"]) for x in xs],
            color=COLORS[tree],
            label=f"{tree}: |resumed - uninterrupted|",
            **STYLES[i],
        )
    frame(ax2, "How far the resume is from the uninterrupted run", "|loss difference|")
    ax2.legend(fontsize=8)
    finish(
        fig,
        "Scenario 4 (#5077): fully_reshardable checkpoint, several padded grad buckets, "
        f"resumed at {save}\n" + said(rows, S4),
        "e2e-5077.png",
    )


def audit_table(folder: Path) -> list[str]:
    """`mcore_fixes audit` of the checkpoints (folder/NAME.json, NAME.rc): a verdict per check."""
    if not folder.is_dir():
        return []
    lines = ["", "| checkpoint | exit | loss-scale | param-index | reshard-padding |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for rc_file in sorted(folder.glob("*.rc")):
        name, rc = rc_file.stem, rc_file.read_text().strip()
        try:
            report = json.loads((folder / f"{name}.json").read_text())
            got = {c["check"]: c["verdict"] for c in report["checks"]}
        except (OSError, ValueError, KeyError):
            text = (folder / f"{name}.txt").read_text(errors="replace").strip().splitlines()
            got = {"loss-scale": (text or ["no output"])[-1][:120]}
        cells = [got.get(c, "") for c in ("loss-scale", "param-index", "reshard-padding")]
        lines.append(f"| {name} | {rc} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--inject", type=int, default=10)
    parser.add_argument("--save", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=0.02)
    args = parser.parse_args()
    runs = Runs(args.runs)
    rows = (
        scenario1(runs, args.inject)
        + scenario2(runs, args.save)
        + scenario3(runs, args.tolerance)
        + scenario4(runs, args.save)
    )
    lines = ["| scenario | tree | verdict | measured |", "| --- | --- | --- | --- |"]
    lines += [f"| {a} | {b} | {v} | {c.replace('|', '/')} |" for a, b, v, c in rows]
    lines += audit_table(args.out / "audit")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "e2e-verdicts.md").write_text(table + "\n")
    try:
        plots(runs, args.out, args.inject, args.save, rows)
    except ImportError as exc:
        print(f"no plots: {exc}")


if __name__ == "__main__":
    main()
