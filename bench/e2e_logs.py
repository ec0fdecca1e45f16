"""Condense the runs of bench/e2e_gpu.sh into one raw log per scenario (docs/gpu/e2e-s*.log).

    python bench/e2e_logs.py RUNS_DIR OUT

RUNS_DIR is the `runs/` folder of e2e-logs.tar.gz (NAME.jsonl, NAME.log, NAME.rc per run) and
holds, or sits beside, e2e-device.txt. Writes OUT/e2e-s1.log, e2e-s2.log and e2e-s3.log: per
run its exit status, bench/e2e_hook.py's step records, then its output without Megatron's
argument dump (the arguments are in bench/e2e_gpu.sh).
"""

from __future__ import annotations

import argparse
from pathlib import Path


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
        f"# e2e runs of scenario {scenario} (bench/e2e_gpu.sh on the H200, {device}); per run: "
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    candidates = [args.runs / "e2e-device.txt", args.runs.parent / "e2e-device.txt"]
    device = next((p.read_text().strip() for p in candidates if p.exists()), "device unknown")
    args.out.mkdir(parents=True, exist_ok=True)
    for scenario in ("s1", "s2", "s3"):
        (args.out / f"e2e-{scenario}.log").write_text(scenario_log(args.runs, scenario, device))


if __name__ == "__main__":
    main()
