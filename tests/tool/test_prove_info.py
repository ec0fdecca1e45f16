"""`prove` (fail-before / pass-after of each patch's test) and `info` (what a fork contains)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from toolworld import MAIN, run_module


def test_prove_proven(project, tool):
    r = tool(
        project, "prove", "--python", sys.executable, "--baseline", "0.1.0", "--patch", "join-sep"
    )
    assert r.rc == 0, r.out + r.err
    row = next(ln for ln in r.out.splitlines() if ln.startswith("0.1.0 "))
    assert "applies, proven" in row
    # Our proof (manifest `proof`): one failing case unpatched, every case passes patched.
    assert "0.1.0 / join-sep: unpatched failed (1 failed, 1 passed)" in r.out
    assert "patched passed (2 passed)" in r.out
    store = json.loads((project / "build/proofs/0.1.0.json").read_text())
    assert set(store) == {"join-sep"}
    proof = store["join-sep"]
    assert proof["verdict"] == "proven"
    assert proof["tests"] == ["tests/proofs/test_join_sep.py"]
    assert proof["before"]["outcome"] == "failed" and proof["after"]["outcome"] == "passed"

    # status shows the stored proof while patch file and pin are unchanged ...
    cells = json.loads(tool(project, "status", "--json", "--baseline", "0.1.0").out)["cells"]
    by_patch = {c["patch"]: c for c in cells}
    assert by_patch["join-sep"]["proof"]["verdict"] == "proven"
    assert "proof" not in by_patch["fix-mean"]
    assert "applies, proven" in tool(project, "status", "--baseline", "0.1.0").out
    # ... also when only the message changes (a proof is about the code) ...
    patch = project / "patches/0002-join-sep.patch"
    patch.write_text(patch.read_text().replace("Forwarded: no", "Forwarded: yes"))
    cells = json.loads(tool(project, "status", "--json", "--baseline", "0.1.0").out)["cells"]
    assert {c["patch"]: c for c in cells}["join-sep"]["proof"]["verdict"] == "proven"
    # ... and drops it once the diff changes.
    lines = patch.read_text().splitlines(keepends=True)
    last = max(i for i, ln in enumerate(lines) if ln.startswith("+") and ln[:4] != "+++ ")
    lines[last] = lines[last].rstrip("\n") + "  # edited\n"
    patch.write_text("".join(lines))
    cells = json.loads(tool(project, "status", "--json", "--baseline", "0.1.0").out)["cells"]
    assert all("proof" not in c for c in cells)


def test_prove_flags_test_that_passes_unpatched(project, tool):
    r = tool(
        project,
        "prove",
        "--python",
        sys.executable,
        "--baseline",
        "0.1.0",
        "--patch",
        "weak-test",
        "--markdown",
    )
    assert r.rc == 1
    assert "| 0.1.0    | a | a | !1 |" in r.out.splitlines()
    assert "`!1` applies, TEST PASSES UNPATCHED" in r.out
    assert "\n- 0.1.0 / weak-test: unpatched passed (" in r.out  # a flagged cell's counts
    store = json.loads((project / "build/proofs/0.1.0.json").read_text())
    assert store["weak-test"]["verdict"] == "passes-unpatched"


def test_prove_whole_series_with_git_baselines(world, project, tool):
    project = world.project(project.parent / "fresh", prebuilt=False)
    r = tool(
        project,
        "prove",
        "--python",
        sys.executable,
        "--mcore-repo",
        world.upstream,
        "--baseline",
        "core_v0.2.0",
    )
    assert r.rc == 1  # weak-test's test cannot fail
    row = r.out.splitlines()[2]
    assert [c.strip() for c in row.split("  ") if c.strip()] == [
        "core_v0.2.0",
        "applied-upstream, proof passes",  # its proof runs on upstream's code
        "applies, proven",
        "applies, TEST PASSES UNPATCHED",
    ]
    proofs = json.loads((project / "build/proofs/core_v0.2.0.json").read_text())
    assert {k: v["verdict"] for k, v in proofs.items()} == {
        "fix-mean": "applied-upstream",
        "join-sep": "proven",
        "weak-test": "passes-unpatched",
    }
    assert proofs["join-sep"]["pin"] == world.commits["core_v0.2.0"]
    # The tree repository is left clean at the patched series.
    tree = project / "build/trees/core_v0.2.0"
    from toolworld import git

    assert git(tree, "status", "--porcelain", "--untracked-files=all") == ""


def test_prove_skips_git_baselines_without_checkout(world, tool, tmp_path):
    project = world.project(tmp_path / "proj", prebuilt=False)
    r = tool(project, "prove", "--python", sys.executable, "--baseline", "core_v0.3.0")
    assert r.rc == 0
    assert "baseline core_v0.3.0 skipped: no Megatron-LM checkout" in r.err
    assert "skipped" in r.out


def test_prove_unknown_patch(project, tool):
    r = tool(project, "prove", "--patch", "nope")
    assert r.rc == 2
    assert "unknown patch 'nope'; known patches: fix-mean, join-sep, weak-test" in r.err


def test_info_of_vendored_tree(project, tool):
    assert tool(project, "vendor").rc == 0
    env = {**os.environ, "PYTHONPATH": str(MAIN)}
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_fixes", "info"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"megatron.core at {project / 'megatron' / 'core'}" in proc.stdout
    assert "base: 0.1.0 (pypi, pin " in proc.stdout
    assert "applied   fix-mean (fix 1; 0001-fix-mean.patch)" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_fixes", "info", "--json"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    data = json.loads(proc.stdout)
    assert data["baseline"] == "0.1.0" and data["location"] == str(project / "megatron/core")


def test_info_without_fork(tmp_path):
    # Only the tool on the path: a vendored ./megatron in the clone must not be found.
    shutil.copytree(MAIN / "mcore_fixes", tmp_path / "tool" / "mcore_fixes")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "tool")}
    r = run_module(tmp_path, "info", cwd=tmp_path, env=env)
    # Either no megatron.core at all (exit 2) or a plain one (exit 1): never a traceback.
    assert r.rc in (1, 2) and "Traceback" not in r.err


def test_prove_needs_a_python_with_pytest(project, tool, tmp_path):
    r = tool(project, "prove", "--python", tmp_path / "no-such-python", "--baseline", "0.1.0")
    assert r.rc == 2
    assert "no-such-python: cannot run it" in r.err and len(r.err.strip().splitlines()) == 1
    fake = tmp_path / "python-without-pytest"
    fake.write_text('#!/bin/sh\necho "$0: No module named pytest" >&2\nexit 1\n')
    fake.chmod(0o755)
    r = tool(project, "prove", "--python", fake, "--baseline", "0.1.0")
    assert r.rc == 2
    assert "`-m pytest` does not run there" in r.err and "No module named pytest" in r.err
    assert not (project / "build/proofs").exists()


def test_test_verb_runs_the_series_tests_on_the_patched_tree(project):
    r = run_module(project, "test", "--baseline", "0.1.0", "--", "-k", "mean or join")
    assert r.rc == 0, r.err
    assert "2 passed, 1 deselected" in r.out
