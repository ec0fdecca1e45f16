"""Peak memory and time of `python -m mcore_fixes audit` on checkpoints of 1 GB of optimizer state.

    python bench/audit_memory.py OUT [--mcore DIR] [--format F ...]

Writes, with the MCore tree DIR on PYTHONPATH (default: ./megatron's parent, the vendored
fork), one checkpoint per format of a model of 84M params (five 4096 x 4096 Linears, one of
them fp32: 1.0 GB of fp32 main params, exp_avg and exp_avg_sq) with tests/audit/writers.py,
then audits each in its own process and prints a table: the optimizer state's size, the
audit's peak resident memory (the process's maximum RSS, from wait4) and its wall time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ("dp_reshardable", "fully_reshardable", "dp_zero_gather_scatter", "legacy")


def optimizer_bytes(ckpt: Path) -> int:
    """Bytes of the optimizer state tensors the checkpoint holds (fp32)."""
    sys.path.insert(0, str(ROOT))
    from mcore_fixes import audit
    from mcore_fixes.audit import ckptread

    files = ckptread.Files()
    try:
        view = audit.read_view(ckpt, files)
        return sum(r.source.numel * 4 for r in view.regions)
    finally:
        files.close()


def measure(ckpt: Path) -> tuple[int, float, int]:
    """(exit status, wall seconds, peak RSS in bytes) of one audit process."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcore_fixes", "audit", str(ckpt)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.monotonic() - start, usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--mcore", type=Path, default=ROOT, help="directory holding megatron/")
    parser.add_argument("--format", action="append", choices=FORMATS)
    args = parser.parse_args()
    formats = args.format or list(FORMATS)
    scenarios = [f"big-{f}" for f in formats if not (args.out / f"big-{f}").exists()]
    if scenarios:
        env = {
            **os.environ,
            "PYTHONPATH": str(args.mcore.resolve()),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        writer = ROOT / "tests" / "audit" / "writers.py"
        subprocess.run(
            [sys.executable, str(writer), str(args.out), *scenarios], env=env, check=True
        )
    print("| format | optimizer state | audit peak RSS | RSS / state | wall | exit |")
    print("| --- | --- | --- | --- | --- | --- |")
    for fmt in formats:
        ckpt = args.out / f"big-{fmt}"
        state = optimizer_bytes(ckpt)
        rc, wall, rss = measure(ckpt)
        print(
            f"| {fmt} | {state / 2**30:.2f} GiB | {rss / 2**20:.0f} MiB | {rss / state:.1%} "
            f"| {wall:.1f} s | {rc} |"
        )


if __name__ == "__main__":
    main()
