"""Patches that carry upstream's own fixes (manifest `origin`, `upstream-pr`,
`upstream-branches`): provenance in status and info, and `applied-upstream` measured by prove on
a baseline that has the commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from toolworld import MAIN

# fix-mean stands for an upstream commit: core_v0.2.0 merged it as is (it reverse-applies there).
CARRIED = (
    'upstream-commit = "0123456789abcdef0123456789abcdef01234567"\n'
    "upstream-pr = 77\n"
    'origin = "upstream"\n'
    'upstream-branches = ["main"]\n'
    'affects = "--mean-flag"\n'
)


@pytest.fixture
def carried(project):
    manifest = project / "patches/manifest.toml"
    text = manifest.read_text()
    anchor = 'proof = "tests/proofs/test_fix_mean.py"\n'
    assert anchor in text
    manifest.write_text(text.replace(anchor, anchor + CARRIED, 1))
    return project


def test_applied_upstream_proof_passes_on_upstreams_code(carried, tool, world):
    args = ("--baseline", "core_v0.2.0", "--mcore-repo", world.upstream)
    r = tool(carried, "prove", "--python", sys.executable, *args, "--patch", "fix-mean")
    assert r.rc == 0, r.out + r.err
    row = next(ln for ln in r.out.splitlines() if ln.startswith("core_v0.2.0 "))
    assert "applied-upstream, proof passes" in row
    assert "fix-mean (#77)" in r.out.splitlines()[0]  # the column names the upstream PR
    assert "core_v0.2.0 / fix-mean: proof on upstream's code: 1 passed" in r.out
    store = json.loads((carried / "build/proofs/core_v0.2.0.json").read_text())
    assert store["fix-mean"]["verdict"] == "applied-upstream"
    assert store["fix-mean"]["before"]["outcome"] == "passed"
    data = json.loads(tool(carried, "status", "--json", *args).out)
    cell = {c["patch"]: c for c in data["cells"]}["fix-mean"]
    assert cell["state"] == "applied-upstream" and cell["proof"]["verdict"] == "applied-upstream"
    patch = {p["id"]: p for p in data["patches"]}["fix-mean"]
    assert patch["upstream"] == {
        "pr": 77,
        "url": "https://github.com/NVIDIA/Megatron-LM/pull/77",
        "origin": "upstream",
        "commit": "0123456789abcdef0123456789abcdef01234567",
        "branches": ["main"],
        "affects": "--mean-flag",
    }


def test_info_lists_the_upstream_fixes_the_fork_adds(carried, tool):
    assert tool(carried, "vendor").rc == 0
    env = {**os.environ, "PYTHONPATH": str(MAIN)}
    cmd = [sys.executable, "-m", "mcore_fixes", "info"]
    proc = subprocess.run(cmd, cwd=carried, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "upstream's own fixes this fork adds to 0.1.0 (not in this base):" in proc.stdout
    link = "https://github.com/NVIDIA/Megatron-LM/pull/77"
    assert f"  #77 fix-mean (merged on main): {link}\n      affects: --mean-flag\n" in proc.stdout
    info = json.loads((carried / "megatron/core/_mcore_fixes.json").read_text())
    assert {a["id"]: a.get("upstream", {}).get("pr") for a in info["applied"]} == {
        "fix-mean": 77,
        "join-sep": None,
        "weak-test": None,
    }


BAD_ORIGINS = {
    "no-pr": ('origin = "upstream"\n', "needs the upstream-pr"),
    "unknown": ('upstream-pr = 1\norigin = "vendor"\n', "must be one of upstream, upstream-pr"),
    "merged-without-commit": (
        'upstream-pr = 1\norigin = "upstream"\nupstream-branches = ["main"]\n',
        "needs upstream-commit and upstream-branches",
    ),
    "open-pr-on-a-branch": (
        'upstream-pr = 1\norigin = "upstream-pr"\nupstream-branches = ["main"]\n',
        "cannot name upstream-branches",
    ),
    "pr-not-a-number": ('upstream-pr = "5077"\n', "must be a pull-request number"),
    "affects-not-text": ("affects = 1\n", "affects 1 must be a string"),
}


@pytest.mark.parametrize("case", sorted(BAD_ORIGINS))
def test_bad_provenance_is_one_line(project, tool, case):
    keys, words = BAD_ORIGINS[case]
    manifest = project / "patches/manifest.toml"
    anchor = 'proof = "tests/proofs/test_fix_mean.py"\n'
    manifest.write_text(manifest.read_text().replace(anchor, anchor + keys, 1))
    r = tool(project, "status", "--baseline", "0.1.0")
    assert r.rc == 2 and words in r.err and "Traceback" not in r.err


def test_apply_says_which_upstream_fix_a_release_already_has(carried, tool, world, tmp_path):
    """A release that shipped upstream's commit (the manifest's applied-upstream): `apply`
    says the fix is upstream's code there, not that an earlier apply put it in; the status
    cell says where it comes from."""
    manifest = carried / "patches/manifest.toml"
    manifest.write_text(
        manifest.read_text()
        + '[baselines."core_v0.2.0".applied-upstream]\nfix-mean = "0123456789 (#77), shipped"\n'
    )
    co = world.clone(tmp_path / "co", "core_v0.2.0")
    r = tool(carried, "apply", "--dry-run", co)
    assert r.rc == 0, r.err
    assert (
        "  upstream #77:\n    fix-mean: already in core_v0.2.0: 0123456789 (#77), shipped\n"
        in r.out
    )
    args = ("--baseline", "core_v0.2.0", "--mcore-repo", world.upstream, "--json")
    cells = {c["patch"]: c for c in json.loads(tool(carried, "status", *args).out)["cells"]}
    assert cells["fix-mean"]["detail"] == "already in this baseline: 0123456789 (#77), shipped"
