"""Checkpoints for the audit tests, written by real MCore trees (writers.py).

Each writer is one process on one tree: a pristine baseline (build/trees/<baseline> at its
`pristine` tag) or the fork (that baseline with the series applied, as `vendor` builds it),
cloned into a temporary directory so that the tool's own trees are never moved. The writers run
concurrently (one import of torch and megatron.core each); git baselines need MCORE_REPO.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mcore_fixes import git, manifest, series, sources  # noqa: E402
from mcore_fixes.progress import Progress  # noqa: E402

WRITER = Path(__file__).resolve().parent / "writers.py"


@dataclass(frozen=True)
class Writer:
    baseline: str
    fork: bool

    @property
    def label(self) -> str:
        return f"{'fork of ' if self.fork else ''}{self.baseline}"


@dataclass
class Written:
    """What one writer wrote: its tree, its output directory, each scenario's outcome."""

    tree: Path
    out: Path
    outcomes: dict[str, str]

    def code(self, marker: str) -> bool:
        """Whether the tree's DistributedOptimizer source contains `marker`."""
        source = self.tree / "megatron/core/optimizer/distrib_optimizer.py"
        return marker in source.read_text()


def _tree(w: Writer, dest: Path) -> Path | str:
    """A clone of the writer's tree in `dest` (pristine or with the series), or a skip reason."""
    m = manifest.load(ROOT / "patches" / "manifest.toml")
    b = m.baseline(w.baseline)
    trees = ROOT / "build" / "trees"
    repo = sources.mcore_repo_from(None)
    if b.is_git and repo is None and not sources.cached(b, trees):
        return f"{w.baseline} needs a Megatron-LM checkout (MCORE_REPO)"
    with sources.project_lock(ROOT, Progress()):
        tree = sources.pristine_tree(b, trees, repo, Progress())
        git.run(
            dest.parent, "clone", "-q", "--shared", str(tree), str(dest), env=git.NEUTRAL_CONFIG
        )
    marker = git.TOOL_TREE_MARKER  # a tool tree: git runs there without the user's config
    (dest / ".git" / marker).write_text((tree / ".git" / marker).read_text())
    git.run(dest, "reset", "-q", "--hard", "pristine")
    if w.fork:
        series.apply_series(dest, m, b)
    return dest


def _write(w: Writer, scenarios: list[str], tmp: Path) -> Written | str:
    tree = _tree(w, tmp / "tree")
    if isinstance(tree, str):
        return tree
    out = tmp / "out"
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, str(WRITER), str(out), *scenarios],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    written = out / "written.json"
    if not written.exists():
        raise AssertionError(f"{w.label}: the writer failed:\n{proc.stderr[-4000:]}")
    return Written(tree, out, json.loads(written.read_text()))


def write_all(plan: dict[Writer, list[str]], tmp_path_factory) -> dict[Writer, Written | str]:
    """Every writer's checkpoints (or why it was skipped), writers side by side."""
    jobs = max(1, min(len(plan), os.cpu_count() or 1, 4))
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {
            w: pool.submit(_write, w, scenarios, tmp_path_factory.mktemp(w.label.replace(" ", "-")))
            for w, scenarios in plan.items()
        }
        return {w: f.result() for w, f in futures.items()}
