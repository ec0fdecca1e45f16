"""`prove`: each patch's regression test must fail on the tree without the fix and pass with it."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

from . import git
from .errors import UserError
from .manifest import Baseline, Manifest
from .progress import Progress
from .series import APPLIES, Cell, apply_series, diff_sha256, read_patch, test_files

PROOFS_DIR = Path("build") / "proofs"
_SUMMARY = re.compile(r"\b\d+ (passed|failed|errors?|skipped|deselected)\b|no tests ran")


def pytest_command(python: str, files: list[str]) -> list[str]:
    # --noconftest: upstream's conftest needs Python 3.12 and data helpers (DESIGN.md).
    # -o addopts=: the baseline's pyproject.toml adds -x (0.16.1) and -s; we want every result.
    return [
        python,
        "-m",
        "pytest",
        "--noconftest",
        "-o",
        "addopts=",
        "-p",
        "no:cacheprovider",
        "-q",
        *files,
    ]


@functools.cache
def check_python(python: str) -> None:
    """UserError unless `python -m pytest` runs: a missing pytest must not read as a failure."""
    try:
        proc = subprocess.run(
            [python, "-m", "pytest", "--version"], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"--python {python}: cannot run it ({exc})") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise UserError(f"--python {python}: `-m pytest` does not run there ({last})")


def run_tests(tree: Path, files: list[str], python: str) -> dict:
    """Run `files` with the tree on PYTHONPATH; outcome is passed / failed / error / no-tests."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        proc = subprocess.run(
            pytest_command(python, files),
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    except subprocess.TimeoutExpired:
        return {"outcome": "error", "rc": None, "summary": "timed out after 900 s"}
    lines = [ln.strip("= ") for ln in proc.stdout.splitlines() if _SUMMARY.search(ln)]
    summary = lines[-1] if lines else (proc.stderr.strip().splitlines() or [""])[-1]
    outcome = {0: "passed", 1: "failed", 5: "no-tests"}.get(proc.returncode, "error")
    return {"outcome": outcome, "rc": proc.returncode, "summary": summary}


def verdict(before: dict, after: dict) -> str:
    if before["outcome"] == "passed":
        return "passes-unpatched"  # already fixed upstream, or a test that cannot fail
    if after["outcome"] != "passed":
        return "fails-patched"
    if before["outcome"] in ("failed", "error"):
        return "proven"
    return "no-proof"


def _checkout(tree: Path, rev: str) -> None:
    git.run(tree, "checkout", "-q", "-f", "--detach", rev)
    git.run(tree, "clean", "-q", "-fdx")


def prove_baseline(
    root: Path,
    manifest: Manifest,
    b: Baseline,
    tree: Path,
    python: str,
    only: list[str] | None,
    progress: Progress,
) -> list[Cell]:
    """Prove every applicable patch of `b` (or those in `only`); results go to build/proofs/."""
    check_python(python)
    cells = apply_series(tree, manifest, b)
    head = git.out(tree, "rev-parse", "HEAD")
    store = load_proofs(root, b.name)
    keys = proof_keys(manifest, cells)
    for cell in cells:
        if cell.state != APPLIES or (only and cell.patch not in only):
            continue
        path = manifest.root / cell.file
        tests = test_files(read_patch(path))
        if not tests:
            cell.proof = {"verdict": "no-test"}
        else:
            _checkout(tree, f"{cell.commit}^")
            git.run(tree, "apply", "--include=tests/*", str(path))
            progress.step(f"{b.name} {cell.patch}: tests without the fix")
            before = run_tests(tree, tests, python)
            _checkout(tree, cell.commit)
            progress.step(f"{b.name} {cell.patch}: tests with the fix")
            after = run_tests(tree, tests, python)
            cell.proof = {"verdict": verdict(before, after), "before": before, "after": after}
        cell.proof |= {"key": keys[cell.patch], "pin": b.pin, "tests": tests}
        store[cell.patch] = cell.proof
    _checkout(tree, head)
    out = root / PROOFS_DIR / f"{b.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(store, indent=1) + "\n")
    return cells


def proof_keys(manifest: Manifest, cells: list[Cell]) -> dict[str, str]:
    """Per applied patch, a hash of its diff and of the diffs applied before it.

    A proof depends on the code it ran on: the messages of the patches do not count.
    """
    keys: dict[str, str] = {}
    running = hashlib.sha256()
    for cell in cells:
        if cell.state == APPLIES:
            running.update(diff_sha256(manifest.root / cell.file).encode())
            keys[cell.patch] = running.hexdigest()
    return keys


def load_proofs(root: Path, baseline: str) -> dict:
    path = root / PROOFS_DIR / f"{baseline}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def attach_proofs(root: Path, manifest: Manifest, b: Baseline, cells: list[Cell]) -> None:
    """Attach stored proofs to cells, only where the baseline and the diffs are unchanged."""
    store = load_proofs(root, b.name)
    keys = proof_keys(manifest, cells)
    for cell in cells:
        proof = store.get(cell.patch)
        if not proof or cell.state != APPLIES:
            continue
        if proof.get("pin") == b.pin and proof.get("key") == keys.get(cell.patch):
            cell.proof = proof
