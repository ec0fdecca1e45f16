"""lint-patches: upstream's checks per commit; formatters judge whole files, commit vs parent."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from mcore_fixes.maint import lint

PATCH = """\
diff --git a/megatron/core/x.py b/megatron/core/x.py
--- a/megatron/core/x.py
+++ b/megatron/core/x.py
@@ -1,2 +1,3 @@
 def upstream( a ):
     return a
+value = {'a':1}
"""


def test_added_lines_per_file() -> None:
    assert lint.added_lines(PATCH) == {"megatron/core/x.py": {"value = {'a':1}"}}


UPSTREAM = "def upstream( a ):\n    return a\n\n\ndef other():\n    return 1\n"
needs_black = pytest.mark.skipif(shutil.which("black") is None, reason="needs black on PATH")


def _tree(tmp_path: Path, text: str, rel: str = "megatron/core/x.py") -> Path:
    target = tmp_path / "tree" / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return tmp_path / "tree"


@needs_black
def test_only_what_the_commit_introduces_counts(tmp_path: Path) -> None:
    # upstream's own `def upstream( a ):` fails the pinned black before and after: not ours
    tree = _tree(tmp_path, UPSTREAM + "value = {'a':1}\n")
    before = {"megatron/core/x.py": UPSTREAM}
    found = lint.formatter_problems(tree, ["megatron/core/x.py"], before, names=("black",))
    assert found == {"black": ["megatron/core/x.py:7: black would rewrite: value = {'a':1}"]}
    tree = _tree(tmp_path, UPSTREAM + "\n\nvalue = {'a': 1}\n")
    assert lint.formatter_problems(tree, ["megatron/core/x.py"], before, names=("black",)) == {
        "black": []
    }


@needs_black
def test_the_whole_file_is_checked(tmp_path: Path) -> None:
    # a new test function right after the previous one: no changed line is badly formatted,
    # black inserts two blank lines (a line-range check of the added lines misses it)
    rel = "tests/unit_tests/test_x.py"
    old = "def test_a():\n    assert True\n"
    tree = _tree(tmp_path, old + "def test_b():\n    assert True\n", rel)
    found = lint.formatter_problems(tree, [rel], {rel: old}, names=("black",))
    assert found == {
        "black": [f"{rel}:3: black would rewrite: missing blank line(s) before `def test_b():`"]
    }
    # a file the commit adds: every rewrite is the commit's
    found = lint.formatter_problems(tree, [rel], {rel: None}, names=("black",))
    assert len(found["black"]) == 1
    # outside upstream's pre-commit scope (megatron/training is not black-checked upstream)
    assert not lint.in_scope("black", "megatron/training/x.py")
    assert not lint.in_scope("isort", "tests/unit_tests/test_x.py")


def test_formatter_diffs_are_matched_as_multisets() -> None:
    diff = (
        "--- /t/megatron/core/x.py:before\t2026\n+++ /t/megatron/core/x.py:after\t2026\n"
        "@@ -1,3 +1,3 @@\n-import c\n+import b\n import d\n-import b\n"
    )
    runs = lint.parse_diff(diff, ["megatron/core/x.py"])["megatron/core/x.py"]
    assert [(h.line, h.changed) for h in runs] == [
        (1, ("-import c", "+import b")),
        (3, ("-import b",)),
    ]
    moved = lint.Hunk(9, runs[1].changed, ("other", ""))
    assert lint.introduced([moved], runs) == []  # the same rewrite upstream already needed
    assert lint.introduced([moved, moved], runs) == [moved]  # ... but only once
    other = lint.Hunk(1, ("-import x",), runs[0].context)  # same neighbours, another rewrite
    assert lint.introduced([other], runs) == [other]


NEW_FILE = """\
diff --git a/tests/unit_tests/test_new.py b/tests/unit_tests/test_new.py
new file mode 100644
--- /dev/null
+++ b/tests/unit_tests/test_new.py
@@ -0,0 +1,2 @@
+{first}
+def test_x(): pass
"""


@pytest.mark.parametrize(
    "first, ok",
    [
        ("# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.", True),
        ("# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.", True),
        ("# Copyright 2026 Someone Else", False),
    ],
)
def test_copyright_header_of_added_files(tmp_path: Path, first: str, ok: bool) -> None:
    patch = NEW_FILE.format(first=first)
    (tmp_path / "tests" / "unit_tests").mkdir(parents=True)
    (tmp_path / "tests/unit_tests/test_new.py").write_text(f"{first}\ndef test_x(): pass\n")
    problems = lint.copyright_problems(tmp_path, patch)
    assert problems == (
        []
        if ok
        else ["tests/unit_tests/test_new.py: no NVIDIA copyright line in its first 10 lines"]
    )


def test_pins_come_from_upstreams_files() -> None:
    pyproject = '[dependency-groups]\nlinting = ["ruff~=0.9.0", "black==26.3.0", "pylint==3.2.6"]\n'
    precommit = "- repo: https://github.com/pycqa/isort\n  rev: 5.13.2\n"
    assert lint.read_pins(pyproject, precommit) == {
        "black": "26.3.0",
        "pylint": "3.2.6",
        "isort": "5.13.2",
    }


def test_without_a_checkout_formatters_follow_the_baselines_own_pins(tmp_path: Path) -> None:
    """An sdist of 0.14 .. 0.18 ships a pyproject.toml pinning black 24.4.2, not main's 26.3.0."""
    (tmp_path / "pyproject.toml").write_text(
        '[project.optional-dependencies]\nlinting = ["black==24.4.2", "isort==5.13.2", '
        '"pylint==3.2.6"]\n'
    )
    assert lint.tree_formatter_pins(tmp_path) == {"black": "24.4.2", "isort": "5.13.2"}
    assert lint.tree_formatter_pins(tmp_path / "no-such-tree") == {}
    # main's pins are those on PATH (nox installs them): no extra environment
    assert lint.formatter_python(tmp_path, {"black": lint.DEFAULT_PINS["black"]}, None) is None


def test_added_line_numbers() -> None:
    diff = "+++ b/m.py\n@@ -3,0 +4,2 @@\n+a\n+b\n@@ -9 +11 @@\n-c\n+d\n"
    assert lint.added_line_numbers(diff) == {"m.py": {4, 5, 11}}


def test_without_a_checkout_the_upstream_checks_are_skipped(project, tool) -> None:
    res = tool(project, "lint-patches", "--baseline", "0.1.0")
    assert "0.1.0: skipped api, pylint: no Megatron-LM checkout" in res.out
    # the toy series' test files carry no copyright line: upstream's CI would refuse them
    assert "0.1.0  fix-mean                   copyright FAIL  1 file(s)" in res.out
    assert "    tests/unit_tests/test_mean.py: no NVIDIA copyright line" in res.out
    assert "0.1.0: 3 commit(s), 30 checks: 3 failed" in res.out
    assert res.rc == 1


def _has(*mods: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) for m in mods)


TOY_API_CHECK = """\
import subprocess, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
changed = subprocess.run(["git", "diff", "--name-only", args["--baseline"], args["--current"]],
                         capture_output=True, text=True).stdout
if "megatron/core/util.py" in changed:
    print("   \\u2192 megatron/core/util.py:0: join_names(sep): Parameter was added")
    sys.exit(1)
"""


@pytest.mark.skipif(not _has("pylint", "griffe", "black", "isort"), reason="needs lint tools")
def test_per_commit_checks_with_a_checkout(world, project, tool, tmp_path) -> None:
    import importlib.metadata as md
    import re as re_mod

    from toolworld import commit_all, write

    repo = world.clone(tmp_path / "mlm", "core_v0.1.1")
    pins = {n: md.version(n) for n in ("black", "isort", "pylint")}
    deps = ", ".join(f'"{n}=={v}"' for n, v in pins.items())
    text = (repo / "pyproject.toml").read_text() + f"\n[dependency-groups]\nlinting = [{deps}]\n"
    write(repo, "pyproject.toml", text)
    write(repo, "scripts/check_api_backwards_compatibility.py", TOY_API_CHECK)
    write(repo, ".pylintrc", "[MESSAGES CONTROL]\ndisable=all\nenable=C0116\n")
    commit = commit_all(repo, "CI inputs")
    manifest = project / "patches" / "manifest.toml"
    old = world.commits["core_v0.1.1"]
    manifest.write_text(re_mod.sub(old, commit, manifest.read_text()))
    res = tool(project, "lint-patches", "--baseline", "core_v0.1.1", "--mcore-repo", repo,
               "--tools-python", sys.executable)  # fmt: skip
    lines = res.out.splitlines()
    assert "core_v0.1.1  fix-mean                   api       ok  0 breaking changes" in lines
    assert "core_v0.1.1  join-sep                   api       FAIL  1 breaking change(s)" in lines
    # double() has no docstring: upstream's line, not counted against the patch
    ok = "pylint    ok  1 file(s); 1 on upstream's own lines (not counted)"
    assert f"core_v0.1.1  fix-mean                   {ok}" in lines
    assert res.rc == 1


@pytest.mark.skipif(not _has("torch", "pytest"), reason="needs an interpreter with torch")
def test_a_pypi_baseline_skips_collect_in_one_line(world, project, tool, tmp_path) -> None:
    # weak-test also edits upstream's test_basic.py, which the sdist lacks: on 0.1.0 its tests
    # are left out, while fix-mean's new test file gives the patched tree a tests/unit_tests/
    from toolworld import FORMAT_PATCH, PATCH_FILES, commit_all, git, write

    repo = world.clone(tmp_path / "mlm", "core_v0.1.0")
    write(repo, "megatron/core/constants.py", "ANSWER = 42\n")
    write(repo, "tests/unit_tests/test_basic.py", "def test_basic():\n    assert True\n")
    commit_all(repo, "Add constants module\n\nWhy, in a paragraph.\n")
    (project / "patches" / PATCH_FILES["weak-test"]).write_text(git(repo, *FORMAT_PATCH))
    res = tool(project, "lint-patches", "--baseline", "0.1.0", "--python", sys.executable)
    assert "Traceback" not in res.err, res.err
    why = "0.1.0: skipped collect: a PyPI sdist has no upstream tests/ (collect them on a git "
    assert why in res.out, res.out
    assert " collect " not in res.out  # no row per patch: said once
    assert "0.1.0: 3 commit(s), 30 checks:" in res.out


def test_a_griffe_worktree_left_by_a_killed_api_check_is_dropped(tmp_path: Path) -> None:
    """A lint run killed during upstream's API check leaves griffe's worktree and branch in the
    tool's tree; the next check of that commit must not fail on them."""
    from toolworld import commit_all, git, write

    tree = tmp_path / "tree"
    tree.mkdir()
    git(tree, "init", "-q")
    write(tree, "a.py", "x = 1\n")
    sha = commit_all(tree, "one")
    git(tree, "worktree", "add", "-q", "-b", f"griffe-{sha}", str(tmp_path / "wt"), sha)
    git(tree, "branch", f"griffe-{'0' * 40}", sha)  # its worktree already gone
    lint.drop_stale_griffe_worktrees(tree)
    assert git(tree, "branch", "--list", "griffe-*").strip() == ""
    assert not (tmp_path / "wt").exists()
    git(tree, "worktree", "add", "-q", "-b", f"griffe-{sha}", str(tmp_path / "wt"), sha)
