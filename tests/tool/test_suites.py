"""`suites`: upstream's suites pristine vs patched, and the carried tests fail-before/pass-after.

The real run needs GPUs and torchrun; here a stand-in `torchrun` (rank 0 of one, then
`python -m pytest`) runs the toy series' own tests, so the pipeline is exercised end to end.
"""

from __future__ import annotations

from toolworld import fake_torchrun

from mcore_fixes.maint import suites

PATCH = """\
diff --git a/tests/unit_tests/test_optimizer.py b/tests/unit_tests/test_optimizer.py
--- a/tests/unit_tests/test_optimizer.py
+++ b/tests/unit_tests/test_optimizer.py
@@ -10,3 +10,9 @@ def test_existing(x):
     assert x
+
+
+class TestScaler:
+    def test_scales_agree(self):
+        pass
@@ -30,2 +36,2 @@ def test_changed_body():
-    assert 1
+    assert 2
diff --git a/megatron/core/x.py b/megatron/core/x.py
--- a/megatron/core/x.py
+++ b/megatron/core/x.py
@@ -1 +1 @@
-def test_not_a_test(): pass
+def test_not_a_test(): return 1
"""


def test_carried_tests_are_the_added_and_changed_test_functions():
    assert suites.carried_tests([PATCH]) == {
        "tests/unit_tests/test_optimizer.py": {"test_scales_agree", "test_changed_body"}
    }


def test_a_context_def_after_an_added_blank_line_is_not_carried():
    patch = (
        "diff --git a/tests/test_x.py b/tests/test_x.py\n"
        "--- a/tests/test_x.py\n+++ b/tests/test_x.py\n"
        "@@ -5,2 +5,5 @@ import torch\n"
        "+def test_new():\n+    pass\n+\n+\n"
        " def test_untouched_neighbour():\n"
    )
    assert suites.carried_tests([patch]) == {"tests/test_x.py": {"test_new"}}


def test_te_import_is_guarded(tmp_path):
    f = tmp_path / "tests" / "test_x.py"
    f.parent.mkdir()
    f.write_text("import torch\nfrom transformer_engine.pytorch.fp8 import fp8_autocast\n")
    assert suites.guard_te_imports(tmp_path, ["tests"]) == ["tests/test_x.py"]
    text = f.read_text()
    assert "try:" in text and "    from transformer_engine.pytorch.fp8 import fp8_autocast" in text
    compile(text, "x", "exec")
    assert suites.guard_te_imports(tmp_path, ["tests"]) == []  # idempotent


def test_junit_merge_takes_the_worst_rank(tmp_path):
    for rank, state in ((0, ""), (1, '<failure message="x"/>')):
        (tmp_path / f"p.rank{rank}.xml").write_text(
            f'<testsuites><testsuite><testcase classname="tests.a" name="test_b">{state}'
            "</testcase></testsuite></testsuites>"
        )
    got = suites.read_junit(sorted(tmp_path.glob("p.rank*.xml")))
    assert got.by_id == {"tests.a::test_b": "failed"} and got.files == 2


def test_pristine_vs_patched_on_a_checkout(world, project, tool, tmp_path):
    checkout = world.clone(tmp_path / "Megatron-LM", "core_v0.1.0")
    out = tmp_path / "out"
    args = ["suites", checkout, "--baseline", "0.1.0", "--python", fake_torchrun(tmp_path)]
    res = tool(project, *args, "--out", out, "--suite", "tests/unit_tests")
    assert res.rc == 0, res.text
    report = (out / "report.md").read_text()
    assert "- pristine: 1 tests (1 passed)" in report
    assert "- patched: 4 tests (4 passed)" in report
    # the carried tests: two fail on pristine code, the weak one passes there
    rows = {
        line.split(" | ")[0][2:]: line.split(" | ")[-1].rstrip(" |")
        for line in report.splitlines()
        if line.startswith("| tests.")
    }
    assert rows["tests.unit_tests.test_mean::test_mean_of_three"] == "proven"
    assert rows["tests.unit_tests.test_join::test_join_with_separator"] == "proven"
    assert (
        rows["tests.unit_tests.test_constants::test_trivial"] == "passes unpatched (compatibility)"
    )
    assert "REGRESSION" not in report
    assert (out / "patched.rank0.xml").exists() and (out / "pristine.log").exists()
