"""lint-patches judges only the lines a patch adds, with upstream's black settings."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from mcore_fixes import lint

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


@pytest.mark.skipif(shutil.which("black") is None, reason="needs black on PATH")
def test_flags_only_the_patch_lines(tmp_path: Path) -> None:
    target = tmp_path / "megatron" / "core" / "x.py"
    target.parent.mkdir(parents=True)
    target.write_text("def upstream( a ):\n    return a\nvalue = {'a':1}\n")
    problems = [p for p in lint.lint(tmp_path, [PATCH]) if "black" in p]
    # upstream's own `def upstream( a ):` is not ours to judge; our line is flagged
    assert problems == ["megatron/core/x.py: black would rewrite: value = {'a':1}"]
    target.write_text("def upstream( a ):\n    return a\n\n\nvalue = {'a': 1}\n")
    clean = PATCH.replace("+value = {'a':1}", "+value = {'a': 1}")
    assert [p for p in lint.lint(tmp_path, [clean]) if "black" in p] == []


@pytest.mark.skipif(shutil.which("black") is None, reason="needs black on PATH")
def test_line_ranges_give_the_same_verdict(tmp_path: Path) -> None:
    target = tmp_path / "megatron" / "core" / "x.py"
    target.parent.mkdir(parents=True)
    target.write_text("def upstream( a ):\n    return a\nvalue = {'a':1}\n")
    numbers = lint.added_line_numbers(PATCH.replace("@@ -1,2 +1,3 @@", "@@ -2,0 +3 @@"))
    assert numbers == {"megatron/core/x.py": {3}}
    problems = lint.lint(tmp_path, [PATCH], only="black", line_numbers=numbers)
    assert problems == ["megatron/core/x.py: black would rewrite: value = {'a':1}"]
    assert lint._ranges({3, 4, 5, 9}) == ["--line-ranges=3-5", "--line-ranges=9-9"]


@pytest.mark.skipif(shutil.which("black") is None, reason="needs black on PATH")
def test_black_without_line_ranges_formats_the_whole_file(tmp_path: Path) -> None:
    # A checkout may pin a black before 23.11 (no --line-ranges): same verdict, whole file.
    tools = tmp_path / "bin"
    tools.mkdir()
    old_black = tools / "black"
    old_black.write_text(
        "#!/bin/sh\nfor a; do case $a in --line-ranges*) echo \"No such option '--line-ranges'\""
        f' >&2; exit 2;; esac; done\nexec {shutil.which("black")} "$@"\n'
    )
    old_black.chmod(0o755)
    target = tmp_path / "tree" / "megatron" / "core" / "x.py"
    target.parent.mkdir(parents=True)
    target.write_text("def upstream( a ):\n    return a\nvalue = {'a':1}\n")
    numbers = {"megatron/core/x.py": {3}}
    problems = lint.lint(tmp_path / "tree", [PATCH], tools, only="black", line_numbers=numbers)
    assert problems == ["megatron/core/x.py: black would rewrite: value = {'a':1}"]


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


def test_added_line_numbers() -> None:
    diff = "+++ b/m.py\n@@ -3,0 +4,2 @@\n+a\n+b\n@@ -9 +11 @@\n-c\n+d\n"
    assert lint.added_line_numbers(diff) == {"m.py": {4, 5, 11}}


def test_without_a_checkout_the_upstream_checks_are_skipped(project, tool) -> None:
    res = tool(project, "lint-patches", "--baseline", "0.1.0")
    assert "0.1.0: skipped api, pylint: no Megatron-LM checkout" in res.out
    # the toy series' test files carry no copyright line: upstream's CI would refuse them
    assert "0.1.0  fix-mean                   copyright FAIL  1 file(s)" in res.out
    assert "    tests/unit_tests/test_mean.py: no NVIDIA copyright line" in res.out
    assert "0.1.0: 3 commit(s) x 5 checks: 3 failed" in res.out
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
