"""`apply`: put the series onto a user's Megatron-LM checkout, all or nothing."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from . import git
from .errors import CheckFailed, UserError
from .manifest import Baseline, Manifest
from .series import conflict_detail, read_patch

_VERSION_FIELD = re.compile(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*(.+?)\s*$", re.M)


def toplevel(path: Path) -> Path:
    if not path.exists():
        raise UserError(f"{path} does not exist")
    proc = git.run(path, "rev-parse", "--show-toplevel", check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise UserError(f"{path} is not a git work tree (a clone or a linked worktree)")
    return Path(proc.stdout.strip())


def package_version(checkout: Path) -> str:
    """MAJOR.MINOR.PATCH[PRE_RELEASE] of megatron/core/package_info.py, read, not executed."""
    info = checkout / "megatron" / "core" / "package_info.py"
    if not info.exists():
        raise UserError(f"{checkout} is not a Megatron-LM checkout: {info} not found")
    fields = {k: v.strip("'\"") for k, v in _VERSION_FIELD.findall(info.read_text())}
    try:
        return (
            f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{fields.get('PRE_RELEASE', '')}"
        )
    except KeyError:
        raise UserError(f"{info}: cannot read MAJOR/MINOR/PATCH") from None


def detect_baseline(manifest: Manifest, checkout: Path) -> tuple[Baseline, str]:
    """The baseline of a checkout: its pinned commit, else its package_info.py version."""
    head = git.out(checkout, "rev-parse", "HEAD")
    for b in manifest.baselines.values():
        if b.is_git and b.commit == head:
            return b, f"HEAD is the pinned commit of {b.name}"
    version = package_version(checkout)
    for b in manifest.baselines.values():
        if b.version == version:
            return b, f"megatron/core/package_info.py says {version}"
    known = ", ".join(f"{b.name} ({b.version})" for b in manifest.baselines.values())
    raise UserError(
        f"{checkout} (megatron-core {version}, HEAD {head[:10]}) matches no baseline of the "
        f"series; known: {known}. Pass --baseline NAME to choose one explicitly."
    )


def apply(manifest: Manifest, checkout: Path, b: Baseline, commit: bool) -> list[tuple[str, str]]:
    """Apply every patch of `b` not yet present; return (patch id, what happened) per patch.

    Everything is checked before anything is written: a dirty touched file, staged changes
    (commit mode), an operation in progress or a conflict refuses with the checkout untouched.
    """
    for marker in ("rebase-apply", "rebase-merge", "MERGE_HEAD"):
        if (checkout / git.out(checkout, "rev-parse", "--git-path", marker)).exists():
            raise CheckFailed(f"{checkout}: a git am/rebase/merge is in progress; finish it first")

    report: list[tuple[str, str]] = []
    todo: list[tuple[str, Path, str]] = []
    for p in manifest.patches:
        path = manifest.patch_file(b, p)
        if path is None:
            report.append((p.id, f"absent on {b.name}: {b.absent[p.id]}"))
            continue
        text = read_patch(path)
        if git.ok(checkout, "apply", "-R", "--check", str(path)):
            report.append((p.id, "already applied"))
            continue
        todo.append((p.id, path, text))
    if not todo:
        return report

    touched = sorted({t for _, _, text in todo for t in git.touched_paths(text)})
    dirty = git.out(checkout, "status", "--porcelain", "--", *touched)
    if dirty:
        raise CheckFailed(
            f"{checkout} has uncommitted changes in files the series touches; commit or stash "
            f"them first (nothing was changed):\n{dirty}"
        )
    if commit and not git.ok(checkout, "diff", "--cached", "--quiet"):
        raise CheckFailed(f"{checkout} has staged changes; commit or unstage them first")

    # Check the whole series in order against a scratch index: the checkout is not touched.
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
        git.run(checkout, "read-tree", "HEAD", env=env)
        for patch_id, path, _ in todo:
            proc = git.run(checkout, "apply", "--cached", str(path), check=False, env=env)
            if proc.returncode != 0:
                raise CheckFailed(
                    f"patch {patch_id} ({path.name}) {conflict_detail(proc.stderr)}; "
                    f"{checkout} was left unchanged"
                )

    files = [str(path) for _, path, _ in todo]
    if commit:
        env = {} if git.ok(checkout, "var", "GIT_COMMITTER_IDENT") else git.TOOL_IDENTITY
        proc = git.run(checkout, "am", "-q", "--keep-cr", *files, check=False, env=env)
        if proc.returncode != 0:
            git.run(checkout, "am", "--abort", check=False)
            raise CheckFailed(f"git am failed, checkout restored: {proc.stderr.strip()}")
    else:
        done: list[str] = []
        for f in files:
            proc = git.run(checkout, "apply", f, check=False)
            if proc.returncode != 0:
                for g in reversed(done):
                    git.run(checkout, "apply", "-R", g, check=False)
                raise CheckFailed(f"git apply failed, checkout restored: {proc.stderr.strip()}")
            done.append(f)
    how = "committed" if commit else "applied to the work tree (not committed)"
    report.extend((patch_id, how) for patch_id, _, _ in todo)
    order = [p.id for p in manifest.patches]
    return sorted(report, key=lambda r: order.index(r[0]))
