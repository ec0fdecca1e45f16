"""lint-patches judges only the lines a patch adds, with upstream's black settings."""

from __future__ import annotations

import shutil
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
