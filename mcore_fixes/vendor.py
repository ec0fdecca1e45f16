"""The vendored tree: `megatron/` (+ the patches' tests) in the repository root, and its export."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tomllib
from pathlib import Path

from . import git
from .errors import CheckFailed, UserError
from .manifest import Baseline, Manifest
from .progress import Progress
from .series import OK_STATES, Cell, apply_series, file_sha256

INFO_NAME = "_mcore_fixes.json"  # written into megatron/core/, shipped with the install
STATE_NAME = "vendor.json"  # in build/: baseline and file hashes of the vendored tree
IGNORED_SUFFIXES = (".pyc", ".so", ".pyd")


def _hash_tree(root: Path, rel_dirs: list[str], rel_files: list[str]) -> dict[str, str]:
    hashes: dict[str, str] = {}
    for rel in rel_dirs:
        for path in sorted((root / rel).rglob("*")):
            if path.is_file() and not _ignored(path):
                hashes[path.relative_to(root).as_posix()] = _sha(path)
    for rel in rel_files:
        if (root / rel).is_file():
            hashes[rel] = _sha(root / rel)
    return hashes


def _ignored(path: Path) -> bool:
    return "__pycache__" in path.parts or path.suffix in IGNORED_SUFFIXES or path.name == INFO_NAME


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def base_metadata(tree: Path) -> dict:
    """The baseline's own requirements and extras, from its pyproject.toml (kept by setup.py)."""
    path = tree / "pyproject.toml"
    project = tomllib.loads(path.read_text())["project"] if path.exists() else {}
    return {
        "requires-python": project.get("requires-python", ">=3.10"),
        "dependencies": project.get("dependencies", ["torch", "numpy", "packaging"]),
        "optional-dependencies": project.get("optional-dependencies", {}),
    }


def info_record(manifest: Manifest, b: Baseline, tree: Path, cells: list[Cell]) -> dict:
    """What a vendored tree (and so an installed fork) contains, for `info` and setup.py."""
    patches = {p.id: p for p in manifest.patches}
    return {
        "baseline": b.name,
        "version": b.version,
        "source": b.source,
        "pin": b.pin,
        "applied": [
            {
                "id": c.patch,
                "fix": patches[c.patch].fix,
                "file": c.file,
                "sha256": file_sha256(manifest.root / c.file),
            }
            for c in cells
            if c.state == "applies"
        ],
        "not_applied": [
            {"id": c.patch, "fix": patches[c.patch].fix, "state": c.state, "reason": c.detail}
            for c in cells
            if c.state != "applies"
        ],
        "base_metadata": base_metadata(tree),
    }


def local_edits(root: Path) -> list[str]:
    """Files of the vendored tree that differ from what `vendor` wrote (edited, added, removed)."""
    state = _load_state(root)
    if state is None:
        return []
    now = _hash_tree(root, ["megatron"], state["test_files"])
    old: dict[str, str] = state["files"]
    return sorted(p for p in set(now) | set(old) if now.get(p) != old.get(p))


def _load_state(root: Path) -> dict | None:
    path = root / "build" / STATE_NAME
    if not path.exists() or not (root / "megatron").exists():
        return None
    return json.loads(path.read_text())


def vendor(
    root: Path, manifest: Manifest, b: Baseline, tree: Path, force: bool, progress: Progress
) -> dict:
    """Apply the series to the pristine tree and install the result as the vendored tree."""
    edits = local_edits(root)
    if edits and not force:
        raise CheckFailed(
            f"the vendored tree has {len(edits)} local edit(s) (e.g. {edits[0]}); run "
            "`python -m mcore_fixes export` to keep them, or `vendor --force` to discard them"
        )
    previous = _load_state(root)
    if previous is None and (root / "megatron").exists() and not force:
        raise CheckFailed(
            f"{root / 'megatron'} exists but build/{STATE_NAME} (what vendor wrote) is missing, "
            "so its local edits cannot be told apart; move it away or pass `vendor --force`"
        )
    progress.step(f"applying the series to {b.name}")
    cells = apply_series(tree, manifest, b)
    bad = [c for c in cells if c.state not in OK_STATES + ("absent",)]
    if bad:
        lines = "; ".join(f"{c.patch}: {c.state} ({c.detail})" for c in bad)
        raise CheckFailed(f"the series does not apply to {b.name}, nothing vendored: {lines}")
    tests = git.out(tree, "diff", "--name-only", "pristine", "HEAD", "--", "tests").splitlines()
    record = info_record(manifest, b, tree, cells)

    progress.step("writing the vendored tree")
    staging = root / "build" / "vendor-staging"
    if staging.exists():
        shutil.rmtree(staging)
    shutil.copytree(tree / "megatron", staging / "megatron")
    (staging / "megatron" / "core" / INFO_NAME).write_text(json.dumps(record, indent=2) + "\n")
    old = root / "megatron"
    if old.exists():
        shutil.rmtree(old)
    os.replace(staging / "megatron", old)
    shutil.rmtree(staging)
    for rel in (previous or {}).get("test_files", []):
        if rel not in tests:  # the test of a patch not applied on this baseline
            (root / rel).unlink(missing_ok=True)
    for rel in tests:
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / rel, dest)
    state = {
        "baseline": b.name,
        "test_files": tests,
        "files": _hash_tree(root, ["megatron"], tests),
    }
    (root / "build" / STATE_NAME).write_text(json.dumps(state, indent=1) + "\n")
    return record


def vendored_baseline(root: Path) -> str:
    state = _load_state(root)
    if state is None:
        raise UserError("no vendored tree: run `python -m mcore_fixes vendor` first")
    return state["baseline"]


def export(
    root: Path, manifest: Manifest, b: Baseline, tree: Path, into: str | None
) -> list[tuple[str, str]]:
    """Fold edits of the vendored tree into their patches and rewrite the patch files.

    Each edited file goes to the last patch of the series that touches it; a file no patch
    touches goes to `into`.
    Returns (patch file, "updated" | "unchanged") for every patch file this baseline owns.
    """
    if into is not None:
        manifest.patch(into)  # an unknown id is an error even when nothing needs it
    edits = local_edits(root)
    cells = apply_series(tree, manifest, b)
    commits = {c.patch: c for c in cells if c.state == "applies"}
    owners: dict[str, list[str]] = {}
    for rel in edits:
        sha = git.out(tree, "log", "-1", "--format=%H", "pristine..HEAD", "--", rel)
        owner = next((c.patch for c in commits.values() if c.commit == sha), into)
        if owner is None:
            raise CheckFailed(
                f"edited file {rel} belongs to no patch of the series; pass --into PATCH_ID"
            )
        if owner not in commits:
            raise UserError(f"patch {owner} is not applied on {b.name}; cannot export into it")
        owners.setdefault(owner, []).append(rel)

    for owner, rels in owners.items():
        for rel in rels:
            src, dst = root / rel, tree / rel
            if src.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
            else:
                dst.unlink(missing_ok=True)
        git.run(tree, "add", "-A", "--", *rels)
        git.run(
            tree,
            "commit",
            "-q",
            "--no-verify",
            f"--fixup={commits[owner].commit}",
            env=git.TOOL_IDENTITY,
        )
    if owners:
        env = git.TOOL_IDENTITY | {"GIT_SEQUENCE_EDITOR": "true"}
        rebase = git.run(
            tree, "rebase", "-q", "-i", "--autosquash", "pristine", check=False, env=env
        )
        if rebase.returncode != 0:
            git.run(tree, "rebase", "--abort", check=False)
            raise CheckFailed(f"the edits conflict with later patches: {rebase.stderr.strip()}")

    shas = git.out(tree, "rev-list", "--reverse", "pristine..HEAD").splitlines()
    applied = [c for c in cells if c.state == "applies"]
    results: list[tuple[str, str]] = []
    for cell, sha in zip(applied, shas, strict=True):
        target = manifest.root / cell.file
        owned = b.variants.get(cell.patch) == cell.file or b.name == manifest.canonical
        if not owned:
            if cell.patch in owners:
                raise CheckFailed(
                    f"{cell.file} is the canonical patch (targets {manifest.canonical}) but the "
                    f"vendored tree is {b.name}: vendor {manifest.canonical} to edit it, or add "
                    f"a variant for {b.name} in patches/manifest.toml"
                )
            continue
        if cell.excluded:  # the tree lacks upstream's tests: the commit holds the code only
            if cell.patch in owners:
                raise CheckFailed(
                    f"{cell.file} edits upstream test files ({', '.join(cell.excluded)}) that "
                    f"{b.name} does not ship, so it cannot be exported from there; edit it on a "
                    "git baseline (a Megatron-LM checkout)"
                )
            results.append((cell.file, "unchanged"))
            continue
        text = git.run(tree, "format-patch", "-1", sha, *git.FORMAT_PATCH_ARGS).stdout
        changed = target.read_text(encoding="utf-8") != text
        if changed:
            target.write_text(text, encoding="utf-8")
        results.append((cell.file, "updated" if changed else "unchanged"))
    state_path = root / "build" / STATE_NAME
    state = json.loads(state_path.read_text())
    state["files"] = _hash_tree(root, ["megatron"], state["test_files"])
    state_path.write_text(json.dumps(state, indent=1) + "\n")
    return results
