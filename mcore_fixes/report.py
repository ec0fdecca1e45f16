"""The patch x baseline matrix as a terminal table, JSON or Markdown."""

from __future__ import annotations

import json

from .manifest import Manifest, Patch
from .series import Cell

_PROOF_MARK = {
    "proven": "proven",
    "passes-unpatched": "TEST PASSES UNPATCHED",
    "fails-patched": "TEST FAILS PATCHED",
    "no-test": "no test",
    "no-proof": "unproven",
    "no-import-unpatched": "PROOF DOES NOT IMPORT UNPATCHED",
    "no-proof-file": "PROOF FILE MISSING",
    "fixed-upstream": "proof passes unpatched",
    "fixed-upstream-refuted": "PROOF FAILS UNPATCHED",
    "fails-unpatched": "proof fails unpatched",
    "applied-upstream": "proof passes",
    "applied-upstream-refuted": "PROOF FAILS ON UPSTREAM'S CODE",
}


def cell_text(cell: Cell) -> str:
    verdict = cell.proof.get("verdict")
    if verdict:
        return f"{cell.state}, {_PROOF_MARK.get(verdict, verdict)}"
    return cell.state


def column(p: Patch) -> str:
    """A patch's column header: its id and fix, or the upstream PR whose fix it carries."""
    return f"{p.id} (#{p.upstream_pr})" if p.origin else f"{p.id} (fix {p.fix})"


def _grid(manifest: Manifest, cells: list[Cell]) -> tuple[list[str], list[list[str]]]:
    by_key = {(c.baseline, c.patch): c for c in cells}
    baselines = [b for b in manifest.baselines if any(c.baseline == b for c in cells)]
    header = ["baseline"] + [column(p) for p in manifest.patches]
    rows = [
        [b]
        + [cell_text(by_key[(b, p.id)]) if (b, p.id) in by_key else "" for p in manifest.patches]
        for b in baselines
    ]
    return header, rows


def _notes(cells: list[Cell]) -> list[str]:
    notes: list[str] = []
    for c in cells:
        if c.detail and c.state not in ("applies",):
            notes.append(f"{c.baseline} / {c.patch}: {c.state}: {c.detail}")
        if c.proof.get("before") and not c.proof.get("after"):
            b = c.proof["before"]
            tree = "on upstream's code" if c.state == "applied-upstream" else "without the patch"
            notes.append(f"{c.baseline} / {c.patch}: proof {tree}: {b['summary']}")
        elif c.proof.get("before"):
            b, a = c.proof["before"], c.proof["after"]
            notes.append(
                f"{c.baseline} / {c.patch}: unpatched {b['outcome']} ({b['summary']}); "
                f"patched {a['outcome']} ({a['summary']})"
            )
    skipped = {c.detail for c in cells if c.state == "skipped"}
    if len(skipped) == 1:  # one reason (no checkout) for many cells: say it once
        notes = [n for n in notes if ": skipped: " not in n] + [f"skipped: {skipped.pop()}"]
    return notes


def table(manifest: Manifest, cells: list[Cell]) -> str:
    header, rows = _grid(manifest, cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    notes = _notes(cells)
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def markdown(manifest: Manifest, cells: list[Cell]) -> str:
    header, rows = _grid(manifest, cells)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    notes = _notes(cells)
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    return "\n".join(lines)


def variants_text(kinds: list) -> str:
    """One line per variant file: which baselines use it, context-only or backport (why)."""
    if not kinds:
        return ""
    lines = ["", "variants:"]
    for v in kinds:
        line = f"  patches/{v.file} ({', '.join(v.baselines)}): {v.describe()}"
        if v.reason:
            line += f": {v.reason}"
        lines.append(line)
    return "\n".join(lines)


def as_json(manifest: Manifest, cells: list[Cell], kinds: list | None = None) -> str:
    data = {
        "baselines": [
            {
                "name": b.name,
                "source": b.source,
                "version": b.version,
                "pin": b.pin,
            }
            for b in manifest.baselines.values()
        ],
        "patches": [
            {"id": p.id, "fix": p.fix, "file": p.file, "requires": list(p.requires)}
            | ({"upstream": p.upstream_info()} if p.origin else {})
            for p in manifest.patches
        ],
        "cells": [c.as_json() for c in cells],
        "variants": [v.as_json() for v in kinds or []],
    }
    return json.dumps(data, indent=2)
