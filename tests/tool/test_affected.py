"""README's "Am I affected?" table is the manifest's: one row per fix of ours and per upstream
fix the series carries, each with the flags, the damage, the releases that need it (from the
manifest's absent / fixed-upstream / applied-upstream data) and the `audit` check."""

from __future__ import annotations

import re

import pytest
from toolworld import MAIN

from mcore_fixes import manifest
from mcore_fixes.errors import UserError
from mcore_fixes.maint import affected

M = manifest.load(MAIN / "patches" / "manifest.toml")
README = (MAIN / "README.md").read_text(encoding="utf-8")


def block(text: str) -> str:
    start, end = text.index(affected.BEGIN), text.index(affected.END)
    return text[start : end + len(affected.END) + 1]


def test_readme_holds_the_table_the_manifest_gives():
    """After a manifest change: `python -m mcore_fixes docs` writes the table again."""
    assert block(README) == affected.markdown(M)


def test_every_patch_has_its_row_and_every_fix_of_ours_a_name():
    rows = affected.rows(M)
    assert sorted(p for r in rows for p in r.patches) == sorted(p.id for p in M.patches)
    for p in M.patches:
        if p.origin:  # upstream's fix, carried: its own row, named by its PR
            assert [r.name for r in rows if p.id in r.patches] == [f"#{p.upstream_pr}"]
        else:
            assert M.fixes[p.fix].name == M.fix_label(p)
            assert not p.affects and not p.damage  # the row is the fix's ([fixes.N])
    names = [r.name for r in rows]
    assert len(names) == len(set(names))


def lines_needing(patches: list[manifest.Patch]) -> set[str]:
    """The release lines (and main, dev) that take one of `patches`, told from the manifest's
    data directly: not absent there, and neither fixed upstream, nor applied upstream (a
    release that shipped the commit, or the branch of `upstream-branches`)."""
    found = set()
    for b in M.baselines.values():
        line = b.ref if b.is_git else b.version
        line = re.sub(r"^(?:core_v)?(\d+\.\d+)\..*", r"\1", line)
        for p in patches:
            upstream = b.is_git and b.ref in p.upstream_branches
            gone = p.id in b.absent or p.id in b.fixed_upstream or p.id in b.applied_upstream
            if not gone and not upstream:
                found.add(line)
    return found


def expand(releases: str) -> set[str]:
    out = set()
    for part in releases.split(", "):
        m = re.fullmatch(r"0\.(\d+) to 0\.(\d+)", part)
        out |= {f"0.{n}" for n in range(int(m[1]), int(m[2]) + 1)} if m else {part}
    return out


def test_the_releases_of_each_row_are_the_manifests():
    by_id = {p.id: p for p in M.patches}
    for r in affected.rows(M):
        assert expand(r.releases) == lines_needing([by_id[p] for p in r.patches]), r.name
    rows = {r.name: r for r in affected.rows(M)}
    assert rows["#4705"].releases == "0.16 to 0.18, dev"  # 0.19 shipped it, main has it
    assert rows["#5213"].releases == "0.13 to 0.19, main"  # dev has it


def test_each_row_names_an_audit_check_that_exists_or_says_why_none():
    sources = "".join(p.read_text() for p in (MAIN / "mcore_fixes" / "audit").glob("*.py"))
    for r in affected.rows(M):
        assert bool(r.audit) != bool(r.audit_gap), r.name
        if r.audit:
            assert f'"{r.audit}"' in sources, f"{r.name}: no audit check {r.audit!r}"
            assert f"`{r.audit}`" in README  # README's list of the checks explains it


def test_the_fix_names_are_the_docs_names():
    fixes = (MAIN / "docs" / "fixes.md").read_text(encoding="utf-8")
    for fix in M.fixes.values():
        assert f"| {fix.name} ({fix.number}) |" in fixes
    assert not re.search(r"\bfix(?:es)? \d\b", README)  # no fix numbers where users read


CARRIED = """
[[patch]]
id = "new-upstream"
file = "0004-new-upstream.patch"
fix = 5
upstream-pr = 9999
origin = "upstream-pr"
affects = "`--new-flag`"
"""


TOY_FIXES = "".join(
    f'[fixes.{n}]\nname = "toy-{n}"\naffects = "`--toy`"\ndamage = "d"\naudit = "a"\n\n'
    for n in (1, 2, 3)
)


def test_a_new_row_lands_by_manifest_data_alone(project, tool):
    """A carried fix added to the manifest with its texts becomes a row once `docs` runs;
    one without `damage` is refused by name, README untouched."""
    (project / "README.md").write_text(f"# x\n\n{affected.BEGIN}\n{affected.END}\n\nafter\n")
    path = project / "patches" / "manifest.toml"
    head, sep, rest = path.read_text().partition("\n[baselines.")

    def manifest_with(carried: str) -> None:  # [[patch]] entries, [fixes.N], then baselines
        path.write_text(head + carried + "\n" + TOY_FIXES + sep.lstrip("\n") + rest)

    manifest_with(CARRIED)
    before = (project / "README.md").read_text()
    r = tool(project, "docs")
    assert r.rc == 2 and "patch new-upstream (#9999) has no damage" in r.err, r.err
    assert (project / "README.md").read_text() == before
    manifest_with(CARRIED + 'damage = "it breaks"\naudit-gap = "no trace"\n')
    r = tool(project, "docs", "--check")
    assert r.rc == 1 and "run `python -m mcore_fixes docs`" in r.out, r.out + r.err
    assert tool(project, "docs").rc == 0
    readme = (project / "README.md").read_text()
    assert "[#9999](https://github.com/NVIDIA/Megatron-LM/pull/9999)" in readme
    assert "| `--new-flag` | it breaks |" in readme and readme.endswith("\n\nafter\n")
    assert "| none: no trace |" in readme and "**toy-1** (patch `fix-mean`)" in readme
    assert tool(project, "docs", "--check").rc == 0


def test_audit_and_audit_gap_are_one_or_the_other(tmp_path):
    path = tmp_path / "manifest.toml"
    text = (MAIN / "patches" / "manifest.toml").read_text()
    both = 'audit = "loss-scale"\naudit-gap = "x"\n'
    path.write_text(text.replace('audit = "loss-scale"\n', both, 1))
    with pytest.raises(UserError, match="give one of them"):
        manifest.load(path)
