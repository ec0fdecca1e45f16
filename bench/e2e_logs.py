"""Condense the runs of bench/e2e_gpu.sh into one raw log per scenario (docs/gpu/e2e-s*.log).

    python bench/e2e_logs.py RUNS_DIR OUT
    python bench/e2e_logs.py --unpack LOGS_DIR RUNS_DIR

RUNS_DIR is the `runs/` folder of e2e-logs.tar.gz (NAME.jsonl, NAME.log, NAME.rc per run) and
holds, or sits beside, e2e-device.txt. Writes OUT/e2e-s1.log .. e2e-s4.log: per
run its exit status, bench/e2e_hook.py's step records, then its output without Megatron's
argument dump (the arguments are in bench/e2e_gpu.sh). `--unpack` turns those logs (e.g.
docs/gpu/) back into a RUNS_DIR, from which `bench/e2e_report.py` redraws table and plots.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

RUN = re.compile(r"^######## run (\S+) \(exit (-?\d+)\)$", re.M)


def without_arguments(text: str) -> str:
    """The run's output with the block between Megatron's argument dump markers removed."""
    kept, inside = [], False
    for line in text.splitlines():
        marker = line.strip().strip("-").strip() if line.startswith("-----") else ""
        if marker == "arguments":
            inside = True
        elif inside and marker == "end of arguments":
            inside = False
        elif not inside:
            kept.append(line)
    return "\n".join(kept)


def scenario_log(runs: Path, scenario: str, device: str) -> str:
    parts = [
        f"# e2e runs of scenario {scenario} (bench/e2e_gpu.sh, {device}); per run: "
        "exit status, bench/e2e_hook.py's step records, then the run's output with Megatron's "
        "argument dump removed (the arguments are in bench/e2e_gpu.sh)"
    ]
    for rc_file in sorted(runs.glob(f"{scenario}*.rc")):
        name = rc_file.stem
        records = runs / f"{name}.jsonl"
        output = runs / f"{name}.log"
        parts.append(f"\n######## run {name} (exit {rc_file.read_text().strip()})")
        parts.append(records.read_text().rstrip() if records.exists() else "(no step records)")
        parts.append(f"######## output of {name}")
        parts.append(
            without_arguments(output.read_text(errors="replace")) if output.exists() else ""
        )
    return "\n".join(parts) + "\n"


def unpack(logs: Path, runs: Path) -> None:
    """NAME.rc, NAME.jsonl and NAME.log per run of LOGS/e2e-s*.log (what scenario_log wrote)."""
    runs.mkdir(parents=True, exist_ok=True)
    for log in sorted(logs.glob("e2e-s*.log")):
        text = log.read_text(errors="replace")
        heads = list(RUN.finditer(text))
        for head, after in zip(heads, [*heads[1:], None], strict=True):
            name, body = head.group(1), text[head.end() : after.start() if after else None]
            records, _, output = body.partition(f"######## output of {name}\n")
            (runs / f"{name}.rc").write_text(head.group(2) + "\n")
            if records.strip() != "(no step records)":
                (runs / f"{name}.jsonl").write_text(records.strip() + "\n")
            (runs / f"{name}.log").write_text(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unpack", action="store_true", help="logs -> RUNS_DIR (see above)")
    parser.add_argument("runs", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.unpack:
        unpack(args.runs, args.out)
        return
    candidates = [args.runs / "e2e-device.txt", args.runs.parent / "e2e-device.txt"]
    device = next((p.read_text().strip() for p in candidates if p.exists()), "device unknown")
    args.out.mkdir(parents=True, exist_ok=True)
    for scenario in ("s1", "s2", "s3", "s4"):
        (args.out / f"e2e-{scenario}.log").write_text(scenario_log(args.runs, scenario, device))


if __name__ == "__main__":
    main()
