"""The real series on a real Megatron-LM checkout (needs MCORE_REPO): the patch files are the
stack (`vendor` + `export` with no edits rewrites nothing), fix 2's branch for main starts
with upstream's own commit, cherry-picked, and its [Dev] twin does not re-add it (dev has it);
each upstream commit the series carries is offered to the branch that lacks it.

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


def _clone(tmp_path: Path) -> Path:
    clone = tmp_path / "Megatron-LM"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", MCORE_REPO, str(clone)])
    git(clone, "config", "user.name", "Jane Runner")
    git(clone, "config", "user.email", "jane@example.com")
    return clone


def _has(repo: Path, sha: str) -> bool:
    return not subprocess.run(
        ["git", "-C", str(repo), "cat-file", "-e", f"{sha}^{{commit}}"]
    ).returncode


def test_fix_2_for_main_starts_with_upstreams_commit(tmp_path: Path) -> None:
    picked = {p.upstream_commit for p in MANIFEST.patches if p.fix == 2 and p.upstream_commit}
    if not picked:
        pytest.skip("no fix-2 patch names an upstream-commit in patches/manifest.toml")
    (sha,) = picked
    clone = _clone(tmp_path)
    if not _has(clone, sha):
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

    # dev has that commit: its [Dev] twin is our other commits alone, on dev's pinned commit
    dev = MANIFEST.baselines.get("dev")
    if dev is None or not _has(clone, dev.commit):
        return
    assert git(clone, "merge-base", "--is-ancestor", sha, dev.commit) == ""
    twin = git(clone, "log", "--format=%an%x00%B%x01", f"{dev.commit}..mcore-fixes/dev/fix-2")
    entries = [e.strip("\n").split("\0") for e in twin.split("\x01") if e.strip()]
    assert all(author == "Jane Runner" for author, _ in entries)
    assert not any("(cherry picked from commit" in body for _, body in entries)
    left = [p for p in ours if p.id not in dev.fixed_upstream and p.id not in dev.absent]
    assert len(entries) == len(left)


def test_carried_upstream_commits_go_to_the_branch_that_lacks_them(tmp_path: Path) -> None:
    """Each upstream commit the series carries: a `cherry-pick-<PR>` branch on main or dev where
    that branch lacks it (upstream's author kept), none where it has it or fixed it otherwise."""
    from mcore_fixes.maint import upstream

    clone = _clone(tmp_path)
    units = upstream.plan(MANIFEST, None, lambda sha: upstream.pr_number(clone, sha))
    carried = [u for u in units if u.carried and _has(clone, u.commit)]
    if not carried:
        pytest.skip("the series carries no upstream commit this checkout has")
    fixes = [arg for f in sorted({u.fix for u in carried}) for arg in ("--fix", str(f))]
    res = tool(project_copy(tmp_path), "upstream", "--mcore-repo", str(clone), *fixes)
    assert res.returncode == 0, res.stderr
    for u in carried:
        author = git(clone, "log", "-1", "--format=%an", u.commit)
        # an open PR's head (on no branch) is its author's to send: no branch for it
        merged = git(clone, "for-each-ref", "--count=1", "--contains", u.commit, "refs/heads",
                     "refs/remotes")  # fmt: skip
        for name in ("main", "dev"):
            b = MANIFEST.baselines.get(name)
            if b is None or not _has(clone, b.commit):
                continue
            branch = f"mcore-fixes/{'' if name == MANIFEST.canonical else name + '/'}{u.key}"
            made = git(clone, "branch", "--list", branch)
            lacks = subprocess.run(
                ["git", "-C", str(clone), "merge-base", "--is-ancestor", u.commit, b.commit]
            ).returncode
            # a baseline that fixed it its own way (manifest fixed-upstream) needs no twin
            fixed = any(p.id in b.fixed_upstream for p in u.patches)
            assert bool(made) == bool(lacks and merged and not fixed), (u.key, name, res.stdout)
            if made:
                first = git(clone, "rev-list", "--reverse", f"{b.commit}..{branch}").split()[0]
                assert git(clone, "log", "-1", "--format=%an", first) == author
