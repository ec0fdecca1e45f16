"""The series on upstream's dev branch: a real Megatron-LM worktree at dev's pinned commit,
where upstream fixed the distopt index its own way (#5835); needs MCORE_REPO."""

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


def test_apply_to_dev_skips_what_upstream_fixed(tmp_path: Path) -> None:
    dev = MANIFEST.baselines["dev"]
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", MCORE_REPO, str(clone)])
    tree = tmp_path / "dev"
    git(clone, "worktree", "add", "-q", "-b", "dev-work", str(tree), dev.commit)
    git(tree, "config", "user.name", "test")
    git(tree, "config", "user.email", "test@example.com")
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
