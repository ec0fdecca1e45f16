"""`vendor` (pristine baseline + series -> ./megatron) and `export` (edits -> patch files)."""

from __future__ import annotations

import json
import os

from toolworld import (
    CALC_FIXED,
    PATCH_FILES,
    TEST_FILES,
    TEST_MEAN,
    UTIL_SEP,
    sha256,
    tree_snapshot,
)


def test_vendor_default_baseline(world, project, tool):
    r = tool(project, "vendor")
    assert r.rc == 0, r.err
    assert "vendored megatron-core 0.1.0" in r.out
    for pid in PATCH_FILES:
        assert f"applied   {pid}" in r.out
    core = project / "megatron" / "core"
    assert (core / "calc.py").read_text() == CALC_FIXED
    assert (core / "util.py").read_text() == UTIL_SEP
    assert (core / "constants.py").read_text() == "ANSWER = 42\n"
    assert (core / "package_info.py").exists()
    for rel in TEST_FILES.values():
        assert (project / rel).is_file()
    assert (project / TEST_FILES["fix-mean"]).read_text() == TEST_MEAN
    # Only megatron/ of the sdist is vendored, never its pyproject.toml or README.
    assert not (project / "pyproject.toml").exists() and not (project / "README.md").exists()
    info = json.loads((core / "_mcore_fixes.json").read_text())
    assert info["baseline"] == "0.1.0" and info["version"] == "0.1.0"
    assert info["source"] == "pypi" and info["pin"] == world.sdist_sha
    assert [a["id"] for a in info["applied"]] == ["fix-mean", "join-sep", "weak-test"]
    assert info["applied"][0] == {
        "id": "fix-mean",
        "fix": 1,
        "name": "fix 1",
        "file": "0001-fix-mean.patch",
        "sha256": sha256(project / "patches" / "0001-fix-mean.patch"),
    }
    assert info["not_applied"] == []


def test_vendor_git_baseline_records_upstream_and_absent(world, project, tool):
    r = tool(project, "vendor", "--baseline", "core_v0.2.0", "--mcore-repo", world.upstream)
    assert r.rc == 0, r.err
    info = json.loads((project / "megatron/core/_mcore_fixes.json").read_text())
    assert info["pin"] == world.commits["core_v0.2.0"] and info["source"] == "git"
    assert [a["id"] for a in info["applied"]] == ["join-sep", "weak-test"]
    assert info["not_applied"] == [
        {
            "id": "fix-mean",
            "fix": 1,
            "name": "fix 1",
            "state": "applied-upstream",
            "reason": "reverse-applies: already in this baseline (the manifest does not record "
            "it: add it to this baseline's applied-upstream table)",
        }
    ]
    assert "applied-upstream fix-mean" in r.out
    # The test of a patch already upstream is not one of ours: not copied.
    assert not (project / TEST_FILES["fix-mean"]).exists()
    assert (project / TEST_FILES["join-sep"]).exists()

    r = tool(project, "vendor", "--baseline", "core_v0.1.1", "--mcore-repo", world.upstream)
    assert r.rc == 0, r.err
    info = json.loads((project / "megatron/core/_mcore_fixes.json").read_text())
    assert info["not_applied"] == [
        {
            "id": "weak-test",
            "fix": 3,
            "name": "fix 3",
            "state": "absent",
            "reason": "constants.py does not exist in 0.1.1",
        }
    ]
    assert not (project / "megatron/core/constants.py").exists()


def test_vendor_refuses_local_edits_unless_forced(project, tool):
    assert tool(project, "vendor").rc == 0
    calc = project / "megatron/core/calc.py"
    calc.write_text(calc.read_text() + "# my local edit\n")
    (project / "megatron/core/new_module.py").write_text("X = 1\n")
    before = tree_snapshot(project / "megatron")
    r = tool(project, "vendor")
    assert r.rc == 1
    assert "local edit" in r.err and "export" in r.err and "--force" in r.err
    assert len(r.err.strip().splitlines()) == 1
    assert tree_snapshot(project / "megatron") == before

    # Bytecode and caches are not edits.
    (project / "megatron/core/__pycache__").mkdir(exist_ok=True)
    (project / "megatron/core/__pycache__/calc.cpython-311.pyc").write_bytes(b"\0")

    r = tool(project, "vendor", "--force")
    assert r.rc == 0, r.err
    assert "# my local edit" not in calc.read_text()
    assert not (project / "megatron/core/new_module.py").exists()
    assert tool(project, "vendor").rc == 0  # clean again


def test_vendor_ignores_bytecode(project, tool):
    assert tool(project, "vendor").rc == 0
    cache = project / "megatron/core/__pycache__"
    cache.mkdir()
    (cache / "calc.cpython-311.pyc").write_bytes(b"\0")
    assert tool(project, "vendor").rc == 0


def test_vendor_conflicting_series_vendors_nothing(world, project, tool):
    r = tool(project, "vendor", "--baseline", "core_v0.3.0", "--mcore-repo", world.upstream)
    assert r.rc == 1
    assert "does not apply to core_v0.3.0, nothing vendored" in r.err
    assert "join-sep: conflict" in r.err and "megatron/core/util.py" in r.err
    assert not (project / "megatron").exists()
    assert not (project / "tests/unit_tests").exists()

    # An existing vendored tree survives a refused re-vendor.
    assert tool(project, "vendor").rc == 0
    before = tree_snapshot(project / "megatron")
    r = tool(project, "vendor", "--baseline", "core_v0.3.0", "--mcore-repo", world.upstream)
    assert r.rc == 1
    assert tree_snapshot(project / "megatron") == before
    assert tool(project, "vendor").rc == 0  # and it is still known as clean


def test_export_without_edits_is_byte_identical(project, tool):
    before = tree_snapshot(project / "patches")
    assert tool(project, "vendor").rc == 0
    r = tool(project, "export")
    assert r.rc == 0, r.err
    assert r.out.split() == [
        "unchanged",
        "patches/0001-fix-mean.patch",
        "unchanged",
        "patches/0002-join-sep.patch",
        "unchanged",
        "patches/0003-weak-test.patch",
    ]
    assert tree_snapshot(project / "patches") == before


def test_export_folds_edit_into_owning_patch(world, project, tool):
    assert tool(project, "vendor").rc == 0
    patches = project / "patches"
    before = tree_snapshot(patches)
    calc = project / "megatron/core/calc.py"
    calc.write_text(
        calc.read_text().replace(
            "    return total / len(values)", "    # exact for ints\n    return total / len(values)"
        )
    )
    test = project / TEST_FILES["join-sep"]
    test.write_text(
        test.read_text() + '\n\ndef test_default():\n    assert join_names(["a"]) == "a"\n'
    )
    r = tool(project, "export")
    assert r.rc == 0, r.err
    assert "updated   patches/0001-fix-mean.patch" in r.out
    assert "updated   patches/0002-join-sep.patch" in r.out
    assert "unchanged patches/0003-weak-test.patch" in r.out
    after = tree_snapshot(patches)
    assert after["0003-weak-test.patch"] == before["0003-weak-test.patch"]
    assert after["manifest.toml"] == before["manifest.toml"]
    fix_mean = (patches / "0001-fix-mean.patch").read_text()
    assert "+    # exact for ints\n" in fix_mean
    # Header, message and trailers of the patch are kept.
    old = (world.patches / "0001-fix-mean.patch").read_text()
    assert fix_mean.split("\n---\n")[0] == old.split("\n---\n")[0]
    assert "+def test_default():" in (patches / "0002-join-sep.patch").read_text()

    # The export is clean: vendor needs no --force, and reproduces the edit.
    r = tool(project, "vendor")
    assert r.rc == 0, r.err
    assert "# exact for ints" in calc.read_text()
    assert "def test_default" in test.read_text()
    r = tool(project, "export")
    assert r.rc == 0 and "updated" not in r.out


def test_export_unowned_edit_needs_into(project, tool):
    assert tool(project, "vendor").rc == 0
    before = tree_snapshot(project / "patches")
    info = project / "megatron/core/package_info.py"
    info.write_text(info.read_text() + "# note\n")
    calc = project / "megatron/core/calc.py"  # owned by fix-mean, whatever --into says
    calc.write_text(calc.read_text() + "# owned\n")
    r = tool(project, "export")
    assert r.rc == 1
    assert "megatron/core/package_info.py belongs to no patch" in r.err and "--into" in r.err
    assert tree_snapshot(project / "patches") == before

    r = tool(project, "export", "--into", "weak-test")
    assert r.rc == 0, r.err
    assert "updated   patches/0001-fix-mean.patch" in r.out
    assert "unchanged patches/0002-join-sep.patch" in r.out
    assert "updated   patches/0003-weak-test.patch" in r.out
    text = (project / "patches/0003-weak-test.patch").read_text()
    assert "megatron/core/package_info.py" in text and "+# note" in text
    assert "calc.py" not in text
    assert "+# owned" in (project / "patches/0001-fix-mean.patch").read_text()
    r = tool(project, "vendor", "--force")
    assert r.rc == 0
    assert info.read_text().endswith("# note\n")


def test_export_into_unknown_patch(project, tool):
    assert tool(project, "vendor").rc == 0
    (project / "megatron/core/new.py").write_text("Y = 2\n")
    r = tool(project, "export", "--into", "nope")
    assert r.rc == 2 and "nope" in r.err


def test_export_needs_vendored_tree(project, tool):
    r = tool(project, "export")
    assert r.rc == 2
    assert "no vendored tree" in r.err and "vendor" in r.err


def test_export_new_and_deleted_files(project, tool):
    assert tool(project, "vendor").rc == 0
    (project / "megatron/core/constants.py").unlink()  # a file weak-test adds
    (project / "megatron/core/helpers.py").write_text("H = 1\n")
    r = tool(project, "export", "--into", "join-sep")
    assert r.rc == 0, r.err
    weak = (project / "patches/0003-weak-test.patch").read_text()
    assert "megatron/core/constants.py" not in weak
    join = (project / "patches/0002-join-sep.patch").read_text()
    assert "new file mode 100644" in join and "+H = 1" in join
    assert tool(project, "vendor").rc == 0
    assert not (project / "megatron/core/constants.py").exists()
    assert (project / "megatron/core/helpers.py").read_text() == "H = 1\n"


def test_export_of_non_canonical_baseline(world, project, tool):
    before = tree_snapshot(project / "patches")
    assert tool(project, "vendor", "--baseline", "core_v0.2.0").rc == 0  # tree pre-built
    r = tool(project, "export")
    assert r.rc == 0 and r.out == ""  # no variant files for core_v0.2.0: nothing to write
    util = project / "megatron/core/util.py"
    util.write_text(util.read_text() + "# edit\n")
    r = tool(project, "export")
    assert r.rc == 1
    assert "0002-join-sep.patch is the canonical patch (targets 0.1.0)" in r.err
    assert "core_v0.2.0" in r.err and "variant" in r.err
    assert tree_snapshot(project / "patches") == before


def test_vendor_removes_tests_of_patches_no_longer_applied(project, tool):
    assert tool(project, "vendor").rc == 0
    assert (project / TEST_FILES["weak-test"]).exists()
    r = tool(project, "vendor", "--baseline", "core_v0.1.1")
    assert r.rc == 0, r.err
    assert not (project / TEST_FILES["weak-test"]).exists()
    assert (project / TEST_FILES["fix-mean"]).exists()


def test_vendor_refuses_unrecorded_tree(project, tool):
    assert tool(project, "vendor").rc == 0
    (project / "build/vendor.json").unlink()  # e.g. `rm -rf build` after editing megatron/
    calc = project / "megatron/core/calc.py"
    calc.write_text(calc.read_text() + "# precious\n")
    before = tree_snapshot(project / "megatron")
    r = tool(project, "vendor")
    assert r.rc == 1 and "--force" in r.err and "vendor.json" in r.err
    assert tree_snapshot(project / "megatron") == before
    assert tool(project, "vendor", "--force").rc == 0
    assert "# precious" not in calc.read_text()


def test_export_after_an_interrupted_export(project, tool):
    from toolworld import git

    assert tool(project, "vendor").rc == 0
    tree = project / "build/trees/0.1.0"
    # Leave the tree mid-rebase, as a Ctrl-C during `export` would.
    env = {"GIT_SEQUENCE_EDITOR": "sed -i 1s/^pick/edit/", "GIT_CONFIG_GLOBAL": os.devnull}
    git(tree, "rebase", "-q", "-i", "pristine", env=env)
    assert (tree / ".git/rebase-merge").exists()
    calc = project / "megatron/core/calc.py"
    calc.write_text(calc.read_text() + "# after the crash\n")
    r = tool(project, "export")
    assert r.rc == 0, r.err
    assert "+# after the crash" in (project / "patches/0001-fix-mean.patch").read_text()


def _one_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mcore_fixes: error: "), err
    return lines[0]


def test_export_refuses_another_baselines_tree(world, project, tool, tmp_path):
    """megatron/ holds core_v0.2.0's vendored tree while build/vendor.json says 0.1.0 (a
    hand-swapped or interrupted vendor): refused, one line, no patch file written."""
    assert (
        tool(project, "vendor", "--baseline", "core_v0.2.0", "--mcore-repo", world.upstream).rc == 0
    )
    os.replace(project / "megatron", tmp_path / "other")
    assert tool(project, "vendor", "--force").rc == 0
    os.replace(project / "megatron", tmp_path / "mine")
    os.replace(tmp_path / "other", project / "megatron")
    before = tree_snapshot(project / "patches")
    r = tool(project, "export")
    assert r.rc == 1
    msg = _one_error(r.err)
    assert "build/vendor.json says 0.1.0" in msg and "says core_v0.2.0" in msg, msg
    assert "vendor --baseline 0.1.0" in msg and "nothing was written" in msg
    assert tree_snapshot(project / "patches") == before

    (project / "megatron/core/_mcore_fixes.json").unlink()  # a raw copy of some tree
    r = tool(project, "export")
    assert r.rc == 1 and "says nothing readable" in _one_error(r.err)
    assert tree_snapshot(project / "patches") == before


def test_export_refuses_a_missing_patch_file_writing_nothing(world, project, tool):
    assert tool(project, "vendor").rc == 0
    calc = project / "megatron/core/calc.py"
    calc.write_text(calc.read_text() + "\n\ndef triple(x):\n    return 3 * x\n")
    (project / "patches" / PATCH_FILES["join-sep"]).unlink()
    before = tree_snapshot(project / "patches")
    r = tool(project, "export")
    assert r.rc == 1
    msg = _one_error(r.err)
    assert "patch file not found" in msg and f"restore patches/{PATCH_FILES['join-sep']}" in msg
    assert tree_snapshot(project / "patches") == before


def test_export_refuses_a_patch_file_changed_since_vendor(world, project, tool):
    assert tool(project, "vendor").rc == 0
    target = project / "patches" / PATCH_FILES["weak-test"]
    target.write_text(target.read_text().replace("Add constants module", "Add constants"))
    before = tree_snapshot(project / "patches")
    r = tool(project, "export")
    assert r.rc == 1
    assert f"patches/{PATCH_FILES['weak-test']} changed since" in _one_error(r.err)
    assert tree_snapshot(project / "patches") == before


def test_patch_files_are_replaced_all_or_none(tmp_path, monkeypatch):
    from mcore_fixes.maint import vendor as vendor_mod

    a, b = tmp_path / "a.patch", tmp_path / "b.patch"
    a.write_text("old a")
    b.write_text("old b")
    real = os.replace
    calls = []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(vendor_mod.os, "replace", flaky)
    try:
        vendor_mod.replace_all({a: "new a", b: "new b"})
    except OSError:
        pass
    else:
        raise AssertionError("the failure was swallowed")
    assert (a.read_text(), b.read_text()) == ("old a", "old b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.patch", "b.patch"]
