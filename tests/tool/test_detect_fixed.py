"""Baseline detection of a checkout (pinned commit, history, version), refused overrides, and
patches that upstream fixed its own way (`fixed-upstream`)."""

from __future__ import annotations

import json
import shutil
import sys

from toolworld import (
    UTIL_V3,
    add_git_baseline,
    commit_all,
    fake_torchrun,
    git,
    snapshot,
    upstream_branch,
    write,
)

# Upstream's own fix of join-sep's bug, written differently: join-sep conflicts, its proof passes.
UTIL_V4 = UTIL_V3.replace(
    "def join_names(names, *, strict=False):", 'def join_names(names, sep=",", *, strict=False):'
).replace('return ", ".join(str(n) for n in names)', "return sep.join(str(n) for n in names)")


def test_history_outranks_the_version(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.3.0")
    info = co / "megatron/core/package_info.py"
    info.write_text(info.read_text().replace("MINOR = 3", "MINOR = 1"))  # says 0.1.0 now
    git(co, "commit", "-qam", "local version edit")
    r = tool(project, "apply", "--no-commit", co)
    assert "baseline core_v0.3.0 (HEAD is 1 commit(s) after the pinned commit of core_v0.3.0)" in (
        r.out
    ), r.out + r.err


def test_branch_names_the_line(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.2.0", branch="dev")
    write(co, "DEV.md", "dev\n")
    pin = commit_all(co, "dev work")
    git(co, "commit", "-q", "--allow-empty", "-m", "later dev work")
    add_git_baseline(project, "dev", pin, "0.2.0")
    r = tool(project, "apply", "--no-commit", co)
    assert "baseline dev (branch dev, 1 commit(s) after the pinned commit of dev)" in r.out, r.err


def test_override_that_contradicts_the_pin_is_refused(world, project, tool, tmp_path):
    # core_v0.3.0 gets its own file for weak-test: --baseline core_v0.3.0 on core_v0.2.0's
    # pinned commit would commit the wrong variant.
    variant = project / "patches/core_v0.3.0/0003-weak-test.patch"
    variant.parent.mkdir()
    shutil.copy(project / "patches/0003-weak-test.patch", variant)
    manifest = project / "patches/manifest.toml"
    manifest.write_text(
        manifest.read_text().replace(
            '[baselines."core_v0.3.0"]\n',
            '[baselines."core_v0.3.0"]\n'
            'variants = { weak-test = "core_v0.3.0/0003-weak-test.patch" }\n',
        )
    )
    co = world.clone(tmp_path / "co", "core_v0.2.0")
    before = snapshot(co)
    r = tool(project, "apply", "--baseline", "core_v0.3.0", co)
    assert r.rc == 2
    assert "--baseline core_v0.3.0 does not fit" in r.err
    assert "HEAD is the pinned commit of core_v0.2.0" in r.err
    assert snapshot(co) == before
    # Where the patch files are the same either way, the override is harmless and accepted.
    r = tool(project, "apply", "--no-commit", "--baseline", "0.1.0", co)
    assert r.rc == 0, r.err


def _upstream_with_own_fix(world, tmp_path):
    return upstream_branch(world, tmp_path, "core_v0.3.0", {"megatron/core/util.py": UTIL_V4}, "v4")


def _add_v4(project, commit, recorded: str = "") -> None:
    fixed = {"join-sep": recorded} if recorded else {}
    add_git_baseline(project, "v4", commit, "0.4.0", fixed_upstream=fixed)


def test_fixed_upstream_measured_by_prove(world, project, tool, tmp_path):
    up, commit = _upstream_with_own_fix(world, tmp_path)
    _add_v4(project, commit)
    args = ("--baseline", "v4", "--mcore-repo", up)
    cells = json.loads(tool(project, "status", "--json", *args).out)["cells"]
    assert {c["patch"]: c["state"] for c in cells}["join-sep"] == "conflict"
    r = tool(project, "prove", "--python", sys.executable, *args, "--patch", "join-sep")
    assert r.rc == 0, r.out + r.err
    assert "fixed-upstream, proof passes unpatched" in r.out
    assert "record upstream's commit in the manifest" in r.out
    # status keeps the measured state while patch, proof and pin are unchanged
    cells = json.loads(tool(project, "status", "--json", *args).out)["cells"]
    cell = {c["patch"]: c for c in cells}["join-sep"]
    assert cell["state"] == "fixed-upstream" and cell["proof"]["verdict"] == "fixed-upstream"
    assert cell["proof"]["before"]["outcome"] == "passed"


def test_fixed_upstream_recorded_is_skipped_and_the_series_goes_on(world, project, tool, tmp_path):
    up, commit = _upstream_with_own_fix(world, tmp_path)
    _add_v4(project, commit, recorded="0123456789ab (#42)")
    args = ("--baseline", "v4", "--mcore-repo", up)
    r = tool(project, "status", *args)
    assert "v4 / join-sep: fixed-upstream: Applied-Upstream: 0123456789ab (#42)" in r.out
    r = tool(project, "vendor", *args[:2], "--mcore-repo", up)
    assert r.rc == 0, r.err
    info = json.loads((project / "megatron/core/_mcore_fixes.json").read_text())
    assert [a["id"] for a in info["applied"]] == ["weak-test"]
    assert {n["id"]: n["state"] for n in info["not_applied"]}["join-sep"] == "fixed-upstream"
    r = tool(project, "prove", "--python", sys.executable, *args)
    assert r.rc == 1  # weak-test's own test cannot fail; join-sep's claim holds
    store = json.loads((project / "build/proofs/v4.json").read_text())
    assert store["join-sep"]["verdict"] == "fixed-upstream"

    # A user's checkout of that commit: suites and apply skip it and carry on with the rest.
    co = tmp_path / "co"
    git(world.base, "clone", "-q", str(up), str(co))
    git(co, "checkout", "-q", "v4")
    suites = ("suites", co, "--baseline", "v4", "--python", fake_torchrun(tmp_path))
    r = tool(project, *suites, "--out", tmp_path / "out", "--suite", "tests/unit_tests")
    assert r.rc == 0, r.text
    assert "join-sep: fixed upstream (Applied-Upstream: 0123456789ab (#42)" in r.out
    report = (tmp_path / "out" / "report.md").read_text()
    assert "patches: weak-test\n" in report and "fixed upstream, not applied: join-sep" in report
    r = tool(project, "apply", co)
    assert r.rc == 0, r.err
    assert "baseline v4 (HEAD is the pinned commit of v4)" in r.out
    assert "join-sep: fixed upstream (0123456789ab (#42)), skipped" in r.out
    assert "weak-test: committed" in r.out


def test_fixed_upstream_claim_refuted_by_the_proof(world, project, tool):
    manifest = project / "patches/manifest.toml"
    manifest.write_text(
        manifest.read_text() + '\n[baselines."core_v0.3.0".fixed-upstream]\njoin-sep = "nope"\n'
    )
    args = ("--baseline", "core_v0.3.0", "--mcore-repo", world.upstream)
    assert "fixed-upstream" in tool(project, "status", *args).out
    r = tool(project, "prove", "--python", sys.executable, *args, "--patch", "join-sep")
    assert r.rc == 1
    assert "conflict, PROOF FAILS UNPATCHED" in r.out
    assert "the manifest says fixed upstream, but its proof fails" in r.out
