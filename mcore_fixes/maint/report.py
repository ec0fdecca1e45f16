"""The patch x baseline matrix as a terminal table, JSON or Markdown."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

from ..manifest import Manifest, Patch
from ..series import Cell

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


def column(manifest: Manifest, p: Patch) -> str:
    """A patch's column header: its id and fix, or the upstream PR whose fix it carries."""
    return f"{p.id} (#{p.upstream_pr})" if p.origin else f"{p.id} ({manifest.fix_label(p)})"


def _grid(manifest: Manifest, cells: list[Cell]) -> tuple[list[str], list[list[str]]]:
    by_key = {(c.baseline, c.patch): c for c in cells}
    baselines = [b for b in manifest.baselines if any(c.baseline == b for c in cells)]
    header = ["baseline"] + [column(manifest, p) for p in manifest.patches]
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


# Markdown cells: one code per (state, proof verdict), explained under the table.
_CODES = {
    ("applies", "proven"): "P",
    ("applies", None): "a",
    ("applied-upstream", "applied-upstream"): "U",
    ("applied-upstream", None): "u",
    ("fixed-upstream", "fixed-upstream"): "F",
    ("fixed-upstream", None): "f",
    ("absent", None): "-",
    ("conflict", None): "C",
    ("skipped", None): "s",
}
WIDTH = 100  # the Markdown matrix, its legend and notes fit in this many columns


def heads(manifest: Manifest) -> list[str]:
    """Short column heads: the number of each patch file (`0000a-...` -> 0a, `0010-...` ->
    10), else the position in the series."""
    found = [re.match(r"(\d+)([a-z]*)-", Path(p.file).name) for p in manifest.patches]
    short = [str(int(m.group(1))) + m.group(2) if m else "" for m in found]
    if "" in short or len(set(short)) < len(short):
        short = [str(i) for i in range(1, len(manifest.patches) + 1)]
    return short


def _wrap(text: str, first: str = "", rest: str = "") -> list[str]:
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )


def _md_table(rows: list[list[str]]) -> list[str]:
    """A Markdown table; without the spaces around cells where they would pass WIDTH."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    pad = " " if sum(widths) + 3 * len(widths) + 1 <= WIDTH else ""
    line = [
        f"|{pad}"
        + f"{pad}|{pad}".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
        + f"{pad}|"
        for r in rows
    ]
    rule = "|" + "|".join("-" * (w + 2 * len(pad)) for w in widths) + "|"
    return [line[0], rule, *line[1:]]


def markdown(manifest: Manifest, cells: list[Cell]) -> str:
    """The matrix in WIDTH columns: one row per baseline, one short column per patch (its
    file's number), a code per cell; then which patch each column is, what each code means,
    and the notes."""
    by_key = {(c.baseline, c.patch): c for c in cells}
    baselines = [b for b in manifest.baselines if any(c.baseline == b for c in cells)]
    codes: dict[str, str] = {}  # cell text -> code, in order of first use
    flagged = 0

    def code(cell: Cell | None) -> str:
        nonlocal flagged
        if cell is None:
            return ""
        text = cell_text(cell)
        if text not in codes:
            known = _CODES.get((cell.state, cell.proof.get("verdict")))
            if known is None:  # a flagged proof or an unusual state: loud, explained below
                flagged += 1
                known = f"!{flagged}"
            codes[text] = known
        return codes[text]

    short = heads(manifest)
    grid = [["baseline", *short]]
    grid += [[b, *(code(by_key.get((b, p.id))) for p in manifest.patches)] for b in baselines]
    lines = _md_table(grid)
    lines += ["", "Columns, the patches in series order:", ""]
    lines += _md_table(
        [["column", "patch", "fix"]]
        + [
            [h, f"`{p.id}`", manifest.fix_label(p)]
            for h, p in zip(short, manifest.patches, strict=True)
        ]
    )
    legend = "; ".join(f"`{c}` {text}" for text, c in codes.items())
    lines += ["", *_wrap(f"Cells: {legend}.")]
    notes = _md_notes(cells)
    if notes:
        lines.append("")
        for n in notes:
            lines += _wrap(n, "- ", "  ")
    return "\n".join(lines)


_FINE = ("proven", "fixed-upstream", "applied-upstream")  # verdicts the codes say in full


def _md_notes(cells: list[Cell]) -> list[str]:
    """The notes of the Markdown matrix: one per patch and reason (a patch absent from six
    baselines for one reason is one note), and the proof counts only of flagged cells (all of
    them: the terminal table and --json)."""
    why: dict[tuple[str, str, str], list[str]] = {}
    for c in cells:
        if c.detail and c.state not in ("applies", "skipped"):
            why.setdefault((c.patch, c.state, c.detail), []).append(c.baseline)
    notes = [f"`{p}` {state} on {', '.join(bs)}: {d}" for (p, state, d), bs in why.items()]
    for c in cells:
        b, a = c.proof.get("before"), c.proof.get("after")
        if not b or c.proof.get("verdict") in _FINE:
            continue
        if a:
            notes.append(
                f"{c.baseline} / {c.patch}: unpatched {b['outcome']} ({b['summary']}); "
                f"patched {a['outcome']} ({a['summary']})"
            )
        else:
            notes.append(f"{c.baseline} / {c.patch}: proof without the patch: {b['summary']}")
    skipped = {c.detail for c in cells if c.state == "skipped"}
    if len(skipped) == 1:  # one reason (no checkout) for many cells: said once
        return [*notes, f"skipped: {skipped.pop()}"]
    return notes + [
        f"{c.baseline} / {c.patch}: skipped: {c.detail}" for c in cells if c.detail in skipped
    ]


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
