"""The patch files are the series as stacked, and each commit stands alone (stack.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from toolworld import FORMAT_PATCH, commit_all, git, write

from mcore_fixes import manifest
from mcore_fixes.maint import stack


def _section(path: str, pre: str, post: str) -> str:
    return f"diff --git a/{path} b/{path}\nindex {pre}..{post} 100644\n--- a/{path}\n+++ b/{path}\n"


def test_index_lines_chain_through_the_series() -> None:
    one = _section("megatron/core/a.py", "aaaaaaaaaaaa", "bbbbbbbbbbbb")
    one += _section("tests/unit_tests/test_a.py", "111111111111", "222222222222")
    two = _section("megatron/core/a.py", "bbbbbbbbbbbb", "cccccccccccc")
    stale = _section("megatron/core/a.py", "aaaaaaaaaaaa", "dddddddddddd")  # made without `one`
    pristine = {"megatron/core/a.py": "aaaaaaaaaaaa" + "0" * 28}
    assert stack.index_lines(one)[1] == stack.Blobs(
        "tests/unit_tests/test_a.py", "111111111111", "222222222222"
    )
    assert stack.blob_chain([("one", one), ("two", two)], pristine, with_tests=False) == {
        "one": [],
        "two": [],
    }
    found = stack.blob_chain([("one", one), ("stale", stale)], None, with_tests=False)
    assert found["stale"] == [
        "megatron/core/a.py: pre-image aaaaaaaaaaaa is not what one leaves (bbbbbbbbbbbb): "
        "exported from another stack"
    ]
    # the first patch touching a file starts from the pristine file (where the tree is at hand)
    other = {"megatron/core/a.py": "eeeeeeeeeeee"}
    assert stack.blob_chain([("one", one)], other, with_tests=False)["one"] == [
        "megatron/core/a.py: pre-image aaaaaaaaaaaa is not the pristine file (eeeeeeeeeeee): "
        "exported from another stack"
    ]
    # tests/ files count where the baseline has upstream's tests (git baselines) only
    tests_pristine = {**pristine, "tests/unit_tests/test_a.py": "333333333333"}
    assert stack.blob_chain([("one", one)], tests_pristine, with_tests=False)["one"] == []
    assert len(stack.blob_chain([("one", one)], tests_pristine, with_tests=True)["one"]) == 1
    # a file a patch adds has no pre-image; one it adds twice is a broken chain
    new = "diff --git a/megatron/core/n.py b/megatron/core/n.py\nnew file mode 100644\n"
    new += "index 000000000000..ffffffffffff\n"
    assert stack.blob_chain([("new", new)], pristine, with_tests=False)["new"] == []
    assert stack.blob_chain([("new", new), ("again", new)], pristine, True)["again"] != []


def test_undefined_names() -> None:
    src = "import os\n\n\nclass T(Base):\n    def test(self):\n        return helper(os.sep, len)\n"
    assert stack.undefined_names(src) == {"Base", "helper"}
    assert stack.undefined_names("from x import *\nclass T(Base): pass\n") == set()
    assert isinstance(stack.undefined_names("def f(:\n"), str)


def _mean_doc_patch(project: Path, on_fix: bool) -> None:
    """A fourth patch editing calc.py next to fix-mean's line, made on the pristine tree plus
    fix-mean (`on_fix`: it needs fix-mean) or on the pristine tree (an edit elsewhere)."""
    tree = project / "build" / "trees" / "0.1.0"
    scratch = project.parent / "scratch-mean-doc"
    git(tree.parent, "clone", "-q", str(tree), str(scratch))
    git(scratch, "checkout", "-q", "pristine")
    calc = (scratch / "megatron/core/calc.py").read_text()
    if on_fix:
        git(scratch, "am", "-q", str(project / "patches/0001-fix-mean.patch"))
        calc = (scratch / "megatron/core/calc.py").read_text()
        calc = calc.replace("return total / len(values)", "return total / len(values)  # exact")
    else:
        calc = calc.replace("return 2 * x", "return x + x")
    write(scratch, "megatron/core/calc.py", calc)
    commit_all(scratch, "Document mean()\n\nSigned-off-by: A <a@example.com>\n")
    (project / "patches/0004-mean-doc.patch").write_text(git(scratch, *FORMAT_PATCH))
    with (project / "patches/manifest.toml").open("r+") as f:
        text = f.read().replace(
            "\n[baselines.",
            '\n[[patch]]\nid = "mean-doc"\nfile = "0004-mean-doc.patch"\nfix = 4\n\n[baselines.',
            1,
        )
        f.seek(0)
        f.write(text)


def _rows(out: str, patch: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[1] == patch:
            rows[parts[2]] = parts[3]
    return rows


def test_the_stack_is_what_the_patch_files_say(project, tool) -> None:
    res = tool(project, "lint-patches", "--baseline", "0.1.0")
    for patch in ("fix-mean", "join-sep", "weak-test"):
        rows = _rows(res.out, patch)
        assert rows["index"].startswith("ok") and rows["alone"].startswith("ok"), res.out
        assert rows["export"] == "ok  no edits: byte-identical"
        assert rows["names"].startswith("ok")


def test_a_patch_made_on_another_stack_fails_index_and_export(project, tool) -> None:
    # made on pristine, it still applies after fix-mean (context unchanged), but its index
    # line and hunk are not what the stack leaves: `export` would rewrite it
    _mean_doc_patch(project, on_fix=False)
    res = tool(project, "lint-patches", "--baseline", "0.1.0")
    rows = _rows(res.out, "mean-doc")
    assert rows["index"] == "FAIL  1 file(s)", res.out
    assert (
        "megatron/core/calc.py: pre-image" in res.out and "is not what fix-mean leaves" in res.out
    )
    assert rows["export"].startswith("FAIL  would rewrite 0004-mean-doc.patch")
    assert rows["alone"] == "ok  the baseline alone"
    assert res.rc == 1


def test_a_hidden_dependency_names_the_patch_it_needs(project, tool) -> None:
    _mean_doc_patch(project, on_fix=True)
    res = tool(project, "lint-patches", "--baseline", "0.1.0")
    rows = _rows(res.out, "mean-doc")
    assert rows["index"].startswith("ok") and rows["export"].startswith("ok"), res.out
    assert rows["alone"].startswith("FAIL  does not apply at megatron/core/calc.py")
    assert rows["alone"].endswith("hidden dependency: needs fix-mean (not in its requires)")
    # declared, it stands alone
    manifest = project / "patches/manifest.toml"
    manifest.write_text(
        manifest.read_text().replace("fix = 4\n", 'fix = 4\nrequires = ["fix-mean"]\n')
    )
    res = tool(project, "lint-patches", "--baseline", "0.1.0")
    assert _rows(res.out, "mean-doc")["alone"] == "ok  the baseline + fix-mean"


def test_without_a_tree_the_patch_files_alone_are_checked(project, tool) -> None:
    # a git baseline without a checkout (CI): the chain of its patch files is still checked
    _mean_doc_patch(project, on_fix=False)
    manifest = project / "patches/manifest.toml"
    absent = 'absent = { weak-test = "constants.py does not exist in 0.1.1" }\n'
    # core_v0.1.1's own files (a canonical patch's post-image is unknown on another baseline)
    variant = 'variants = { fix-mean = "0001-fix-mean.patch", mean-doc = "0004-mean-doc.patch" }\n'
    manifest.write_text(manifest.read_text().replace(absent, absent + variant))
    shutil.rmtree(project / "build" / "trees" / "core_v0.1.1")
    res = tool(project, "lint-patches", "--baseline", "core_v0.1.1")
    assert (
        "core_v0.1.1  mean-doc                   index     FAIL  megatron/core/calc.py" in res.out
    )
    assert "core_v0.1.1: skipped: no Megatron-LM checkout" in res.out
    assert "index chain of its 3 patch file(s): 1 failed" in res.out
    assert res.rc == 1


def test_prove_alone(project, tool) -> None:
    # each proof fails on the pristine tree + the patch's declared requires, passes with it
    _mean_doc_patch(project, on_fix=True)  # needs fix-mean, undeclared; carries no test
    res = tool(project, "prove", "--alone", "--baseline", "0.1.0", "--patch", "join-sep")
    assert res.rc == 0, res.text
    stored = (project / "build/proofs/0.1.0.alone.json").read_text()
    assert '"verdict": "proven"' in stored and not (project / "build/proofs/0.1.0.json").exists()
    (project / "tests/proofs/test_mean_doc.py").write_text(
        "from megatron.core.calc import mean\n\n\ndef test_mean():\n    assert mean([1, 3]) == 2\n"
    )
    manifest = project / "patches/manifest.toml"
    manifest.write_text(
        manifest.read_text().replace(
            "fix = 4\n", 'fix = 4\nproof = "tests/proofs/test_mean_doc.py"\n'
        )
    )
    res = tool(project, "prove", "--alone", "--baseline", "0.1.0", "--patch", "mean-doc")
    assert res.rc == 1
    assert '"verdict": "not-alone"' in (project / "build/proofs/0.1.0.alone.json").read_text()


def test_without_a_tree_the_chain_leaves_out_what_the_branch_already_has() -> None:
    """On main (no tree at hand), the upstream commits carried from main are in the base, not
    stacked: their files' index lines are upstream's, not links of the series' chain."""
    m = manifest.load(Path(__file__).resolve().parents[2] / "patches" / "manifest.toml")
    carried = {p.id for p in m.patches if "main" in p.upstream_branches}
    assert carried, "the series carries upstream commits from main"
    on_main = {pid for pid, _ in stack.effective_series(m, m.baseline("main"), None)}
    on_tag = {pid for pid, _ in stack.effective_series(m, m.baseline("core_v0.19.0"), None)}
    assert not carried & on_main
    tag = m.baseline("core_v0.19.0")
    assert carried - set(tag.absent) - set(tag.applied_upstream) <= on_tag
    assert "param-group-lr-bounds" in tag.applied_upstream  # 0.19 shipped #4705: not stacked
    assert "param-group-lr-bounds" not in on_tag
