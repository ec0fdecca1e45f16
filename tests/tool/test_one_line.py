"""Odd inputs and odd clones: one clear line, or the right result; never a traceback, never a
check that silently did not run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from test_bad_input import one_line
from toolworld import MAIN, fake_torchrun, git, run_module, snapshot, write

# --- patch files with CRLF line ends (a clone with core.autocrlf=true) -------------------------


def test_patch_files_are_checked_out_byte_exact():
    """.gitattributes: git never converts the line ends of patch files (core.autocrlf=true)."""
    for rel in ("patches/0001-chained-loss-scale.patch", "patches/core_v0.13.1/x.patch"):
        attrs = git(MAIN, "check-attr", "text", "eol", "--", rel)
        assert f"{rel}: text: unset" in attrs or f"{rel}: eol: lf" in attrs, attrs


def _crlf(project: Path) -> None:
    for patch in (project / "patches").rglob("*.patch"):
        patch.write_bytes(patch.read_bytes().replace(b"\n", b"\r\n"))


def test_patch_files_with_crlf_line_ends_work_as_with_lf(world, project, tool, tmp_path):
    want = json.loads(tool(project, "status", "--json").out)
    _crlf(project)
    r = tool(project, "status", "--json")
    assert r.rc == 0, r.err
    got = json.loads(r.out)
    assert [(c["patch"], c["baseline"], c["state"]) for c in got["cells"]] == [
        (c["patch"], c["baseline"], c["state"]) for c in want["cells"]
    ]
    assert tool(project, "vendor").rc == 0
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    r = tool(project, "apply", co)
    assert r.rc == 0, r.err
    assert git(co, "rev-list", "--count", "core_v0.1.0..HEAD").strip() == "3"
    assert b"\r" not in (co / "megatron/core/calc.py").read_bytes()


# --- status with a variant that is not UTF-8 -----------------------------------------------------


def test_status_with_a_variant_that_is_not_utf8_is_one_line(world, tmp_path):
    project = world.project(tmp_path / "proj", prebuilt=False)  # git baselines: skipped
    variant = project / "patches/core_v0.3.0/0002-join-sep.patch"
    variant.parent.mkdir()
    variant.write_bytes((project / "patches/0002-join-sep.patch").read_bytes() + b"caf\xe9\n")
    manifest = project / "patches/manifest.toml"
    manifest.write_text(
        manifest.read_text() + '[baselines."core_v0.3.0".variants]\n'
        'join-sep = "core_v0.3.0/0002-join-sep.patch"\n'
    )
    r = run_module(project, "status")
    assert r.rc == 2, r.text
    assert "0002-join-sep.patch" in one_line(r.err) and "not a text patch" in r.err


# --- lint-patches with a checkout that lacks the pinned commit -----------------------------------

FAKE_TOOLS = """#!/bin/sh
case "$2" in *importlib.metadata*)
  echo '{"black": "26.3.0", "isort": "5.13.2", "pylint": "3.2.6", "griffe": "2.4.1"}'; exit 0;;
esac
exec "%s" "$@"
"""


def test_lint_patches_with_a_checkout_lacking_the_pin_fails(world, project, tool, tmp_path):
    """The baseline's tree is cached, but the checkout does not have its commit: upstream's
    checks cannot run, so lint-patches fails (it does not report `0 failed, N skipped`)."""
    empty = tmp_path / "empty"
    git(world.base, "init", "-q", str(empty))
    tools = tmp_path / "tools" / "python"
    tools.parent.mkdir()
    tools.write_text(FAKE_TOOLS % sys.executable)
    tools.chmod(0o755)
    r = tool(project, "lint-patches", "--baseline", "core_v0.2.0", "--mcore-repo", empty,
             "--tools-python", tools)  # fmt: skip
    assert r.rc == 2, r.text
    msg = one_line(r.err)
    assert world.commits["core_v0.2.0"] in msg and str(empty) in msg
    assert "skipped" not in r.out


# --- suites ----------------------------------------------------------------------------------


def test_suites_given_a_file_that_is_not_a_tarball_is_one_line(project, tmp_path):
    junk = tmp_path / "checkout.tar.gz"
    junk.write_bytes(b"this is no tarball\n")
    r = run_module(project, "suites", junk, "--baseline", "0.1.0")
    assert r.rc == 2, r.text
    assert str(junk) in one_line(r.err) and "tarball" in r.err


def test_suites_tests_the_checkout_as_it_is(world, project, tool, tmp_path):
    """Uncommitted changes and untracked files of the checkout are what is tested (and said)."""
    co = world.clone(tmp_path / "Megatron-LM", "core_v0.1.0")
    write(co, "tests/unit_tests/test_basic.py", "def test_basic():\n    assert False\n")
    write(co, "tests/unit_tests/test_mine.py", "def test_mine():\n    pass\n")
    before = snapshot(co)
    out = tmp_path / "out"
    args = ["suites", co, "--baseline", "0.1.0", "--python", fake_torchrun(tmp_path)]
    r = tool(project, *args, "--out", out, "--suite", "tests/unit_tests")
    report = (out / "report.md").read_text()
    assert "- pristine: 2 tests (1 failed, 1 passed)" in report, report
    assert "1 uncommitted change(s), 1 untracked file(s)" in r.out
    assert "1 uncommitted change(s), 1 untracked file(s)" in report
    assert snapshot(co) == before


def test_apply_and_suites_need_a_commit(world, project, tmp_path):
    co = tmp_path / "co"
    git(world.base, "init", "-q", str(co))
    r = run_module(project, "suites", co)
    assert r.rc == 2 and "has no commit yet" in one_line(r.err)


def test_the_known_manifest_keys_are_one_list():
    """Unknown keys are refused against one list per table (manifest.py), extended in one place
    where a key is added."""
    from mcore_fixes import manifest

    assert {"id", "file", "fix", "requires", "proof", "upstream-commit"} <= manifest.PATCH_KEYS
    assert {"variants", "absent", "fixed-upstream", "backports"} <= manifest.BASELINE_KEYS
    assert manifest.TOP_KEYS == {"canonical", "default", "patch", "fixes", "baselines"}
