"""README's "Am I affected?" table, generated from patches/manifest.toml.

One row per bug: each fix of ours ([fixes.N], its patches together) and each upstream fix the
series carries (a patch with `origin`, named by its PR). A row says which runs it damages (the
flags users type), what goes wrong, the releases that need it (every release line, main and
dev whose baseline takes one of its patches: not `absent`, not already upstream's code there)
and the `audit` check that finds its damage in a checkpoint. `python -m mcore_fixes docs`
writes it into README.md between the BEGIN and END lines; tests/tool/test_affected.py checks
that README holds what the manifest gives.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UserError
from ..manifest import Baseline, Manifest, Patch

BEGIN = (
    "<!-- affected:begin: generated from patches/manifest.toml by `python -m mcore_fixes docs` -->"
)
END = "<!-- affected:end -->"
AUDIT = "python -m mcore_fixes audit PATH"
ROW_KEYS = ("affects", "damage")  # every row needs these; and audit or audit-gap


@dataclass(frozen=True)
class Row:
    name: str  # the fix's name, or `#PR` of a carried upstream fix
    patches: tuple[str, ...]
    affects: str
    damage: str
    releases: str
    audit: str
    audit_gap: str
    url: str = ""  # the upstream PR of a carried fix


def line_of(b: Baseline) -> str:
    """The release line a baseline belongs to (`0.19` for 0.19.2 and core_v0.19.0), or the
    branch it follows (main, dev)."""
    if not b.is_git:
        return ".".join(b.version.split(".")[:2])
    m = re.fullmatch(r"core_v(\d+\.\d+)\.\d+.*", b.ref)
    return m.group(1) if m else b.ref


def _numbered(line: str) -> tuple[int, ...] | None:
    nums = re.fullmatch(r"(\d+)\.(\d+)", line)
    return (int(nums.group(1)), int(nums.group(2))) if nums else None


def needs(m: Manifest, b: Baseline, p: Patch) -> bool:
    """Whether baseline `b` takes patch `p`: its code is there and upstream's fix is not."""
    return m.patch_file(b, p) is not None and not m.upstream_has(b, p)


def releases(m: Manifest, patches: list[Patch]) -> str:
    """The release lines (and main, dev) where one of `patches` is needed, runs of
    consecutive lines written `A to B`: `0.15, 0.17 to 0.19, main, dev`."""
    lines = list(dict.fromkeys(line_of(b) for b in m.baselines.values()))  # manifest order
    wanted = {line_of(b) for b in m.baselines.values() for p in patches if needs(m, b, p)}
    numbered = sorted((ln for ln in lines if _numbered(ln)), key=_numbered)
    parts: list[str] = []
    run: list[str] = []
    for ln in [*numbered, ""]:
        if ln in wanted:
            run.append(ln)
            continue
        if run:
            parts.append(run[0] if len(run) == 1 else f"{run[0]} to {run[-1]}")
        run = []
    parts += [ln for ln in lines if not _numbered(ln) and ln in wanted]  # main, dev
    return ", ".join(parts) or "none"


def rows(m: Manifest) -> list[Row]:
    """Our fixes first (in the order of their first patch), then the carried upstream fixes
    in series order. UserError naming the manifest entry where a row's text is missing."""
    ours: dict[int, list[Patch]] = {}
    for p in m.patches:
        if not p.origin:
            ours.setdefault(p.fix, []).append(p)
    found: list[Row] = []
    for number, patches in ours.items():
        fix = m.fixes.get(number)
        if fix is None:
            raise UserError(
                f"patches/manifest.toml: patch {patches[0].id} belongs to fix {number}, which has "
                f"no [fixes.{number}] table (its name and README row)"
            )
        found.append(_row(fix.name, f"[fixes.{number}]", fix, patches, m))
    for p in m.patches:
        if p.origin:
            found.append(_row(f"#{p.upstream_pr}", f"patch {p.id}", p, [p], m, p.upstream_url))
    return found


def _row(name: str, where: str, src, patches: list[Patch], m: Manifest, url: str = "") -> Row:
    missing = [k for k in ROW_KEYS if not getattr(src, k)]
    if not (src.audit or src.audit_gap):
        missing.append("audit (or audit-gap)")
    if missing:
        raise UserError(
            f"patches/manifest.toml: {where} ({name}) has no {', '.join(missing)}: README's "
            '"Am I affected?" row needs it'
        )
    return Row(
        name=name,
        patches=tuple(p.id for p in patches),
        affects=src.affects,
        damage=src.damage,
        releases=releases(m, patches),
        audit=src.audit,
        audit_gap=src.audit_gap,
        url=url,
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(m: Manifest) -> str:
    """The table, between its BEGIN and END lines."""
    lines = [
        BEGIN,
        "| bug | your run is affected if it uses | what goes wrong without the fix | releases "
        f"| check a checkpoint: `{AUDIT}` |",
        "|---|---|---|---|---|",
    ]
    for r in rows(m):
        if r.url:
            name = f"[{r.name}]({r.url}) (upstream's fix, carried): `{r.patches[0]}`"
        else:
            listed = ", ".join(f"`{p}`" for p in r.patches)
            name = f"**{r.name}** (patch{'es' if len(r.patches) > 1 else ''} {listed})"
        check = f"its `{r.audit}` line" if r.audit else f"none: {r.audit_gap}"
        cells = [name, r.affects, r.damage, r.releases, check]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines.append(END)
    return "\n".join(lines) + "\n"


def replace_block(text: str, block: str, where: str = "README.md") -> str:
    """`text` with its BEGIN..END block replaced by `block`; UserError without one."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise UserError(f"{where} has no `{BEGIN}` ... `{END}` block to write the table into")
    return text[:start] + block + text[end + len(END) + 1 :]
