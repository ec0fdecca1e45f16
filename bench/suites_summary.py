"""Per-test outcomes and failure causes of `mcore_fixes suites` runs, side by side.

    python bench/suites_summary.py OUT LABEL=RESULTS_DIR [LABEL=RESULTS_DIR ...]

Each RESULTS_DIR holds a run's junit files (pristine.rank*.xml, tests-only.rank*.xml,
patched.rank*.xml: the `--out` folder of `suites`, e.g. an unpacked suites-main-junit.tgz).
Writes OUT.tsv (per test: its outcome on pristine, tests-only and patched, per LABEL; "-" where
absent) and prints, per LABEL, the tests that pass on pristine and not on patched (none is
the acceptance) and the first line of each failure message on pristine, counted, with digits
folded, so a reader sees why upstream's tests fail on both trees.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from mcore_fixes.maint.suites import STATES, read_junit


def failure_causes(paths: list[Path]) -> Counter[str]:
    """First line of each failure or error message, digits folded to N."""
    causes: Counter[str] = Counter()
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            for child in case:
                if child.tag in ("failure", "error"):
                    first = (child.get("message") or child.tag).splitlines()[0][:120]
                    causes[re.sub(r"\d+", "N", first)] += 1
                    break
    return causes


def main() -> int:
    out, runs = Path(sys.argv[1]), [arg.split("=", 1) for arg in sys.argv[2:]]
    if not runs or any(len(run) != 2 for run in runs):
        print(__doc__, file=sys.stderr)
        return 2
    outcomes = {
        (label, state): read_junit(sorted(Path(d).glob(f"{state}.rank*.xml"))).by_id
        for label, d in runs
        for state in STATES
    }
    tests = sorted({t for by_id in outcomes.values() for t in by_id})
    header = ["test"] + [f"{state} ({label})" for label, _ in runs for state in STATES]
    lines = ["\t".join(header)]
    for test in tests:
        cells = [outcomes[label, state].get(test, "-") for label, _ in runs for state in STATES]
        lines.append("\t".join([test, *cells]))
    out.with_suffix(".tsv").write_text("\n".join(lines) + "\n")
    for label, d in runs:
        pristine, patched = outcomes[label, "pristine"], outcomes[label, "patched"]
        worse = [t for t, s in pristine.items() if s == "passed" and patched.get(t) != "passed"]
        print(f"## {label}: {len(pristine)} tests on pristine, {len(patched)} on patched")
        print(f"passes on pristine, not on patched: {len(worse)}")
        for t in worse:
            print(f"  {t}: {patched.get(t, 'absent')}")
        print("failures on pristine, by the first line of their message:")
        for cause, n in failure_causes(sorted(Path(d).glob("pristine.rank*.xml"))).most_common():
            print(f"  {n:4d}  {cause}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
