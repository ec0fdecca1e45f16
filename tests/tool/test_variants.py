"""Variants that cannot drift: context-only or declared backports, `regen`, export's notes."""

from __future__ import annotations

import json
import shutil
import subprocess

from toolworld import (
    CALC_BUGGY,
    FORMAT_PATCH,
    MAIN,
    PATCH_FILES,
    add_git_baseline,
    commit_all,
    git,
    tree_snapshot,
    upstream_branch,
)

from mcore_fixes import manifest as manifest_mod
from mcore_fixes.maint import variants


def test_series_variants_do_not_drift():
    """The real series: every variant changes its canonical's lines, or says why it does not."""
    m = manifest_mod.load(MAIN / "patches" / "manifest.toml")
    assert variants.drifted(m) == []


def _upstream_with_moved_context(world, tmp_path):
    """A commit where fix-mean's context changed (the docstring): the canonical does not apply
    as is, but relocates."""
    calc = CALC_BUGGY.replace("Arithmetic mean of a non-empty sequence.", "Mean, reworded.")
    files = {"megatron/core/calc.py": '"""Moved down a line."""\n' + calc}
    return upstream_branch(world, tmp_path, "core_v0.1.1", files, "v5")


def _add_v5(project, commit, backport: str = "") -> None:
    extra = 'absent = { weak-test = "no constants.py" }\n'
    extra += 'variants = { fix-mean = "v5/0001-fix-mean.patch" }\n'
    backports = {"fix-mean": backport} if backport else {}
    add_git_baseline(project, "v5", commit, "0.5.0", extra, backports=backports)


def test_drifted_variant_is_found_and_regen_restores_it(world, project, tool, tmp_path):
    up, commit = _upstream_with_moved_context(world, tmp_path)
    _add_v5(project, commit)
    variant = project / "patches/v5/0001-fix-mean.patch"
    variant.parent.mkdir()
    canonical = (project / "patches" / PATCH_FILES["fix-mean"]).read_text()
    # A hand edit that changes what the patch does: no longer the canonical's lines.
    variant.write_text(canonical.replace("+    return total / len(values)", "+    return 0"))
    m = manifest_mod.load(project / "patches/manifest.toml")
    [v] = variants.variants(m)
    assert (v.kind, v.differ, v.baselines) == ("backport", 2, ["v5"])
    problems = variants.drifted(m)
    assert len(problems) == 1 and "changes other lines than its canonical patch" in problems[0]

    r = tool(project, "status", "--baseline", "v5", "--mcore-repo", up)
    assert "patches/v5/0001-fix-mean.patch (v5): backport, 2 changed line(s) differ" in r.out

    r = tool(project, "regen", "--mcore-repo", up)
    assert r.rc == 0, r.out + r.err
    assert "regenerated patches/v5/0001-fix-mean.patch" in r.out
    m = manifest_mod.load(project / "patches/manifest.toml")
    assert variants.drifted(m) == []
    text = variant.read_text()
    assert text != canonical and text.split("\n---\n")[0] == canonical.split("\n---\n")[0]
    status = json.loads(
        tool(project, "status", "--json", "--baseline", "v5", "--mcore-repo", up).out
    )
    cells = {c["patch"]: c["state"] for c in status["cells"]}
    assert cells["fix-mean"] == "applies" and cells["join-sep"] == "applies"
    assert status["variants"][0]["kind"] == "context-only"
    # Again: nothing to do, byte for byte.
    r = tool(project, "regen", "--mcore-repo", up)
    assert "unchanged patches/v5/0001-fix-mean.patch" in r.out
    # Without the checkout a git baseline's variant is left alone, and said so.
    r = tool(world.project(tmp_path / "bare", prebuilt=False), "regen")
    assert r.rc == 0


def test_declared_backport_is_left_alone_and_export_names_it(world, project, tool, tmp_path):
    up, commit = _upstream_with_moved_context(world, tmp_path)
    _add_v5(project, commit, backport="v5 wants zero")
    variant = project / "patches/v5/0001-fix-mean.patch"
    variant.parent.mkdir()
    canonical = (project / "patches" / PATCH_FILES["fix-mean"]).read_text()
    variant.write_text(canonical.replace("+    return total / len(values)", "+    return 0"))
    before = variant.read_text()
    assert variants.drifted(manifest_mod.load(project / "patches/manifest.toml")) == []
    r = tool(project, "regen", "--mcore-repo", up)
    assert r.rc == 0 and variant.read_text() == before
    r = tool(project, "status", "--baseline", "v5", "--mcore-repo", up)
    assert "backport, 2 changed line(s) differ from the canonical: v5 wants zero" in r.out

    # export of the canonical patch names the backport that may need the same change
    assert tool(project, "vendor").rc == 0
    calc = project / "megatron/core/calc.py"
    calc.write_text(calc.read_text().replace("def double(x):", "def double(x):  # edited"))
    r = tool(project, "export")
    assert r.rc == 0, r.err
    assert "updated   patches/0001-fix-mean.patch" in r.out
    assert "backport  patches/v5/0001-fix-mean.patch (v5) may need the same change" in r.out


def test_declared_backport_that_is_context_only_is_flagged(project):
    variant = project / "patches/core_v0.2.0/0002-join-sep.patch"
    variant.parent.mkdir()
    shutil.copy(project / "patches" / PATCH_FILES["join-sep"], variant)
    manifest = project / "patches/manifest.toml"
    manifest.write_text(
        manifest.read_text().replace(
            '[baselines."core_v0.2.0"]\n',
            '[baselines."core_v0.2.0"]\nvariants = { join-sep = "core_v0.2.0/0002-join-sep.patch" }'
            '\nbackports = { join-sep = "not really" }\n',
        )
    )
    [problem] = variants.drifted(manifest_mod.load(manifest))
    assert "declared a backport but changes exactly the canonical's lines" in problem


HALF = "def half(x):\n    return x / 2\n\n\n"
# v6: an older `double` kept above mean() (a decoy for fuzzy placement) and the canonical's
# last context line changed: GNU patch at fuzz 1+ puts add-half's pure addition after the
# decoy; a three-way merge from the canonical's blobs puts it where it belongs, after mean().
CALC_V6 = CALC_BUGGY.replace(
    '"""Tiny arithmetic helpers."""\n\n\n',
    '"""Tiny arithmetic helpers."""\n\n\ndef triple(x):\n    return 3 * x\n\n\n'
    "def double(x):\n    return x + x\n\n\n",
).replace("    return 2 * x\n", "    return 2 * x  # v6\n")


def _add_half(world, project, tmp_path, calc: str, name: str) -> tuple[str, object]:
    """A pure-addition patch `add-half` in the canonical series, and git baseline `name`
    whose calc.py is `calc`, with a variant of add-half (a stale copy of the canonical)."""
    scratch = tmp_path / "scratch"
    git(world.base, "clone", "-q", str(world.upstream), str(scratch))
    git(scratch, "checkout", "-q", "core_v0.1.0")
    git(scratch, "am", "-q", str(project / "patches" / PATCH_FILES["fix-mean"]))
    fixed = (scratch / "megatron/core/calc.py").read_text()
    (scratch / "megatron/core/calc.py").write_text(
        fixed.replace("\n\n\ndef double", "\n\n\n" + HALF + "def double")
    )
    commit_all(scratch, "Add half()\n\nA pure addition.\n")
    canonical = git(scratch, *FORMAT_PATCH)
    (project / "patches/0004-add-half.patch").write_text(canonical)
    with (project / "patches/manifest.toml").open("a") as f:
        f.write('\n[[patch]]\nid = "add-half"\nfile = "0004-add-half.patch"\nfix = 4\n')
    up, commit = upstream_branch(
        world, tmp_path, "core_v0.1.1", {"megatron/core/calc.py": calc}, name
    )
    variant = project / f"patches/{name}/0004-add-half.patch"
    variant.parent.mkdir()
    variant.write_text(canonical)
    extra = 'absent = { weak-test = "no constants.py" }\n'
    extra += f'variants = {{ add-half = "{name}/0004-add-half.patch" }}\n'
    add_git_baseline(project, name, commit, "0.6.0", extra)
    return up, variant


def test_regen_never_misplaces_a_pure_addition(world, project, tool, tmp_path):
    up, variant = _add_half(world, project, tmp_path, CALC_V6, "v6")
    if shutil.which("patch"):  # the hazard is real: fuzzy placement lands after the decoy
        demo = tmp_path / "demo"
        (demo / "megatron/core").mkdir(parents=True)
        calc = CALC_V6.replace("(len(values) - 1)", "len(values)")
        (demo / "megatron/core/calc.py").write_text(calc)
        subprocess.run(
            ["patch", "-p1", "-F3", "-s", "-f"], cwd=demo, input=variant.read_text(), text=True
        )
        placed = (demo / "megatron/core/calc.py").read_text()
        assert placed.index("def half") < placed.index("def mean"), placed
    r = tool(project, "regen", "--mcore-repo", up)
    assert r.rc == 0, r.out + r.err
    assert "regenerated patches/v6/0004-add-half.patch" in r.out
    assert tool(project, "vendor", "--baseline", "v6", "--mcore-repo", up).rc == 0
    calc = (project / "megatron/core/calc.py").read_text()
    assert calc.index("def mean") < calc.index("def half") < calc.index("return 2 * x  # v6")
    assert calc.count("def half") == 1


def test_regen_refuses_what_does_not_relocate_exactly(world, project, tool, tmp_path):
    """The line next to the addition changed: no exact placement exists; refused, unwritten."""
    calc = CALC_BUGGY.replace("def double(x):", "def double(x, n=2):")
    up, variant = _add_half(world, project, tmp_path, calc, "v7")
    before = variant.read_text()
    r = tool(project, "regen", "--mcore-repo", up)
    assert r.rc == 1
    assert (
        "does not relocate exactly onto v7" in r.out
        and "conflicts in megatron/core/calc.py" in r.out
    )
    assert variant.read_text() == before


def test_regen_refuses_a_missing_patch_file(world, project, tool):
    (project / "patches" / PATCH_FILES["join-sep"]).unlink()
    before = tree_snapshot(project / "patches")
    r = tool(project, "regen")
    assert r.rc == 1
    assert f"restore patches/{PATCH_FILES['join-sep']}" in r.err
    assert tree_snapshot(project / "patches") == before


def test_regen_refuses_a_swapped_vendored_tree(world, project, tool):
    """regen changes variant files a vendored tree's edits are exported against: it first
    checks that tree like export does."""
    assert tool(project, "vendor").rc == 0
    (project / "megatron/core/_mcore_fixes.json").unlink()
    before = tree_snapshot(project / "patches")
    r = tool(project, "regen")
    assert r.rc == 1 and "megatron/ is not the tree vendor wrote" in r.err, r.err
    assert tree_snapshot(project / "patches") == before
