"""The audit's test matrix as a table: which verdicts each writer's checkpoints get.

    python bench/audit_matrix.py OUT [--markdown]

Writes the checkpoints of tests/audit (every writer of its PLAN: pristine baselines and the
fork; main too with MCORE_REPO) under OUT, audits each and prints, per writer and scenario,
the verdicts of loss-scale / param-index / reshard-padding and whether they are the expected
ones (tests/audit/test_audit.py's `expected`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "audit")]

from conftest import Written, write_all  # noqa: E402
from test_audit import PLAN, expected  # noqa: E402

from mcore_fixes.audit import audit  # noqa: E402

SHORT = {"ok": "ok", "damaged": "DAMAGED", "cannot tell": "cannot tell"}


class Dirs:
    """tmp_path_factory's mktemp, under one folder."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=False)
        return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    written = write_all(PLAN, Dirs(args.out))
    print("| writer | scenario | loss-scale | param-index | reshard-padding | as expected |")
    print("| --- | --- | --- | --- | --- | --- |")
    for writer, scenarios in PLAN.items():
        w = written[writer]
        for scenario in scenarios:
            if not isinstance(w, Written) or w.outcomes.get(scenario) != "ok":
                why = w if isinstance(w, str) else w.outcomes.get(scenario, "")
                print(f"| {writer.label} | {scenario} | not written: {why[:60]} | | | |")
                continue
            got = {v.check: v.verdict for v in audit(w.out / scenario).verdicts}
            cells = " | ".join(
                SHORT[got[c]] for c in ("loss-scale", "param-index", "reshard-padding")
            )
            same = "yes" if got == expected(scenario, writer.fork, w) else "**NO**"
            print(f"| {writer.label} | {scenario} | {cells} | {same} |")


if __name__ == "__main__":
    main()
