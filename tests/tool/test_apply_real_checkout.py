"""`apply` on real Megatron-LM worktrees (release tags, release branches, main and dev); needs
MCORE_REPO.

The user's checkout is never touched: each test makes a shared clone of it in a temp dir and
a linked worktree of that clone at the baseline's pinned commit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_fixes import manifest

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = manifest.load(ROOT / "patches" / "manifest.toml")
MCORE_REPO = os.environ.get("MCORE_REPO")

pytestmark = pytest.mark.skipif(
    not MCORE_REPO, reason="needs a Megatron-LM checkout: set MCORE_REPO=/path/to/Megatron-LM"
)


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mcore_fixes", *args], cwd=ROOT, capture_output=True, text=True
    )


def snapshot(tree: Path) -> tuple[str, str, str]:
    """HEAD, index and work tree state, to show a refused apply changed nothing."""
    return (git(tree, "rev-parse", "HEAD"), git(tree, "diff", "--cached"), git(tree, "diff"))


def make_worktree(tmp_path: Path, name: str, *where: str, commit: str = "") -> Path:
    """A linked worktree of a shared clone of MCORE_REPO at baseline `name`'s pinned commit
    (or at `commit`).

    `where`: how `git worktree add` places HEAD there (default detached).
    """
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", MCORE_REPO, str(clone)])
    tree = tmp_path / name
    git(clone, "worktree", "add", "-q", *(where or ("--detach",)), str(tree),
        commit or MANIFEST.baselines[name].commit)  # fmt: skip
    git(tree, "config", "user.name", "test")
    git(tree, "config", "user.email", "test@example.com")
    return tree


@pytest.fixture(params=["core_v0.19.0", "main"])
def worktree(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str]:
    return make_worktree(tmp_path, request.param), request.param


def author_of(patch: Path) -> str:
    """The author name of a format-patch file (its `From: Name <email>` header)."""
    header = next(ln for ln in patch.read_text().splitlines() if ln.startswith("From: "))
    return header.removeprefix("From: ").rsplit(" <", 1)[0]


def test_apply_commits_then_is_idempotent(worktree: tuple[Path, str]) -> None:
    tree, name = worktree
    base = git(tree, "rev-parse", "HEAD")
    first = tool("apply", str(tree))
    assert first.returncode == 0, first.stderr
    assert f"baseline {name}" in first.stdout
    b = MANIFEST.baselines[name]
    applied = [p for p in MANIFEST.patches if MANIFEST.patch_file(b, p)]
    # upstream's own fixes the fork carries are already in main (said so), committed elsewhere
    upstream = [p for p in applied if p.origin and name == MANIFEST.canonical]
    for p in upstream:
        assert f"  {p.id}: already applied" in first.stdout, first.stdout
    committed = [p for p in applied if p not in upstream]
    log = git(tree, "log", "--reverse", "--format=%an", f"{base}..HEAD").splitlines()
    # ours are authored by mcore-fixes, a carried upstream commit by its upstream author
    authors = [author_of(MANIFEST.patch_file(b, p)) for p in committed]
    assert log == authors
    before = snapshot(tree)
    again = tool("apply", str(tree))
    assert again.returncode == 0, again.stderr
    assert "already applied" in again.stdout
    assert snapshot(tree) == before


def test_apply_refuses_dirty_checkout(worktree: tuple[Path, str]) -> None:
    tree, _ = worktree
    target = tree / "megatron/core/optimizer/optimizer.py"
    target.write_text(target.read_text() + "# local work\n")
    before = snapshot(tree)
    result = tool("apply", str(tree))
    assert result.returncode == 1
    assert "uncommitted changes" in result.stderr
    assert snapshot(tree) == before
    assert target.read_text().endswith("# local work\n")


def test_apply_conflict_leaves_checkout_untouched(worktree: tuple[Path, str]) -> None:
    tree, _ = worktree
    target = tree / "megatron/core/optimizer/distrib_optimizer.py"
    text = target.read_text()
    # a context line of distopt-param-index's first hunk (the call that builds the groups)
    anchor = " " * 12 + "self.gbuf_ranges, self.model_param_gbuf_map, self.opt_group_ranges, "
    anchor += "config\n"
    assert text.count(anchor) == 1
    target.write_text(text.replace(anchor, anchor.replace("config", "config  # local")))
    git(tree, "commit", "-qam", "local change in a patched hunk")
    before = snapshot(tree)
    result = tool("apply", str(tree))
    assert result.returncode == 1
    assert "distopt-param-index" in result.stderr
    assert "distrib_optimizer.py" in result.stderr
    assert snapshot(tree) == before
    assert not git(tree, "status", "--porcelain")


def test_apply_to_dev_skips_what_upstream_fixed(tmp_path: Path) -> None:
    """dev has upstream's own fix of the distopt index (#5835): skipped, the rest applied."""
    dev = MANIFEST.baselines["dev"]
    tree = make_worktree(tmp_path, "dev", "-b", "dev-work")
    r = tool("apply", str(tree))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "baseline dev (HEAD is the pinned commit of dev)" in r.stdout
    for patch_id, commit in dev.fixed_upstream.items():
        assert f"{patch_id}: fixed upstream ({commit}), skipped" in r.stdout
    rest = [
        p.id for p in MANIFEST.patches if p.id not in dev.fixed_upstream and p.id not in dev.absent
    ]
    log = git(tree, "log", "--format=%s", f"{dev.commit}..HEAD").splitlines()
    assert 0 < len(log) <= len(rest)
    assert "committed" in r.stdout

    # status on dev: no conflict (a private project root: the clone's build/ is not touched)
    project = tmp_path / "proj"
    shutil.copytree(ROOT / "patches", project / "patches")
    shutil.copytree(ROOT / "tests" / "proofs", project / "tests" / "proofs")
    r = tool(
        "--root", str(project), "status", "--json", "--baseline", "dev", "--mcore-repo", MCORE_REPO
    )
    assert r.returncode == 0, r.stderr
    states = {c["patch"]: c["state"] for c in json.loads(r.stdout)["cells"]}
    assert "conflict" not in states.values(), states
    assert states["distopt-param-index"] == "fixed-upstream"


OLD_TAGS = ["core_v0.13.1", "core_v0.14.0", "core_v0.15.3", "core_v0.16.1"]


@pytest.mark.parametrize("name", OLD_TAGS)
@pytest.mark.parametrize("where", ["tag", "release branch"])
def test_apply_to_a_release_tag_or_its_branch(tmp_path: Path, name: str, where: str) -> None:
    """A checkout at a release tag, or at the head of its release branch (where downstream
    pins sit), takes the tag's baseline (never the PyPI one); each test section that does not
    land is one line saying why; applying again is a no-op."""
    commit = ""
    if where == "release branch":
        branch = f"origin/core_r{name.removeprefix('core_v').rsplit('.', 1)[0]}.0"
        found = subprocess.run(
            ["git", "-C", MCORE_REPO, "rev-parse", "-q", "--verify", f"{branch}^{{commit}}"],
            capture_output=True,
            text=True,
        )
        if found.returncode != 0:
            pytest.skip(f"{branch} is not in {MCORE_REPO}")
        commit = found.stdout.strip()
    tree = make_worktree(tmp_path, name, commit=commit)
    r = tool("apply", str(tree))
    assert r.returncode == 0, r.stdout + r.stderr
    how = "the pinned commit" if not commit else "after the pinned commit"
    assert f"baseline {name} (HEAD is" in r.stdout and how in r.stdout, r.stdout
    b = MANIFEST.baselines[name]
    applied = [p.id for p in MANIFEST.patches if p.id not in b.absent]
    for patch_id in applied:
        assert f"  {patch_id}: committed" in r.stdout, r.stdout
    for line in r.stdout.splitlines():
        if " skipped its upstream test in " in line:
            assert line.split(": ", 2)[2].strip(), line  # with why
    again = tool("apply", str(tree))
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr
