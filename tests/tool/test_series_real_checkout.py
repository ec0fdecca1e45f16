"""The real series on a real Megatron-LM checkout (needs MCORE_REPO): the patch files are the
stack (`vendor` + `export` with no edits rewrites nothing), and fix 2's branch for main starts
with upstream's own commit, cherry-picked.

The user's checkout is never touched: the project is copied to a temp dir, and `upstream`
runs on a shared clone of the checkout.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_apply_real_checkout import MANIFEST, MCORE_REPO, ROOT, git, pytestmark  # noqa: F401


def tool(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mcore_fixes", "--root", str(root), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


def project_copy(tmp_path: Path) -> Path:
    """The tracked files of this project (patches/, the tool) in a temp dir."""
    dest = tmp_path / "project"
    for rel in git(ROOT, "ls-files", "patches", "mcore_fixes").splitlines():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    return dest


def test_vendor_then_export_is_a_no_op_on_main(tmp_path: Path) -> None:
    project = project_copy(tmp_path)
    vendored = tool(project, "vendor", "--baseline", MANIFEST.canonical, "--mcore-repo", MCORE_REPO)
    assert vendored.returncode == 0, vendored.stderr
    exported = tool(project, "export")
    assert exported.returncode == 0, exported.stderr
    assert "updated" not in exported.stdout, exported.stdout
    for rel in git(ROOT, "ls-files", "patches").splitlines():
        assert (project / rel).read_bytes() == (ROOT / rel).read_bytes(), rel


def test_fix_2_for_main_starts_with_upstreams_commit(tmp_path: Path) -> None:
    picked = {p.upstream_commit for p in MANIFEST.patches if p.fix == 2 and p.upstream_commit}
    if not picked:
        pytest.skip("no fix-2 patch names an upstream-commit in patches/manifest.toml")
    (sha,) = picked
    clone = tmp_path / "Megatron-LM"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", MCORE_REPO, str(clone)])
    git(clone, "config", "user.name", "Jane Runner")
    git(clone, "config", "user.email", "jane@example.com")
    if subprocess.run(["git", "-C", str(clone), "cat-file", "-e", f"{sha}^{{commit}}"]).returncode:
        pytest.skip(f"the checkout lacks upstream commit {sha[:10]}")
    res = tool(project_copy(tmp_path), "upstream", "--mcore-repo", str(clone), "--fix", "2")
    assert res.returncode == 0, res.stderr
    base = MANIFEST.baseline(MANIFEST.canonical).commit
    commits = git(clone, "rev-list", "--reverse", f"{base}..mcore-fixes/fix-2").split()
    first = git(clone, "log", "-1", "--format=%an%n%B", commits[0])
    upstream_author = git(clone, "log", "-1", "--format=%an", sha)
    assert first.splitlines()[0] == upstream_author
    assert f"(cherry picked from commit {git(clone, 'rev-parse', sha)})" in first
    assert "Signed-off-by: Jane Runner <jane@example.com>" in first
    ours = [p for p in MANIFEST.patches if p.fix == 2 and not p.upstream_commit]
    assert len(commits) == 1 + len(ours)
