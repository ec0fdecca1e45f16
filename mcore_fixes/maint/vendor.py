"""The vendored tree: `megatron/` (+ the patches' tests) in the repository root, and its export."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tomllib
from pathlib import Path

from .. import git
from ..errors import CheckFailed, UserError
from ..installed import INFO_NAME
from ..manifest import Baseline, Manifest, Patch
from ..progress import Progress
from ..series import OK_STATES, Cell, apply_series, file_sha256, read_patch, test_files

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


def files_digest(hashes: dict[str, str]) -> str:
    """One sha256 of a `_hash_tree` record (the vendored tree's own record of its files)."""
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


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
                "name": manifest.fix_label(patches[c.patch]),
                "file": c.file,
                "sha256": file_sha256(manifest.root / c.file),
                **({"left_out": c.excluded} if c.excluded else {}),
                **_upstream(patches[c.patch]),
            }
            for c in cells
            if c.state == "applies"
        ],
        "not_applied": [
            {
                "id": c.patch,
                "fix": patches[c.patch].fix,
                "name": manifest.fix_label(patches[c.patch]),
                "state": c.state,
                "reason": c.detail,
            }
            | _upstream(patches[c.patch])
            for c in cells
            if c.state != "applies"
        ],
        "base_metadata": base_metadata(tree),
    }


def _upstream(p: Patch) -> dict:
    """The upstream fix a patch carries, for the record (`info` lists them with links)."""
    return {"upstream": p.upstream_info()} if p.origin else {}


def local_edits(root: Path) -> list[str] | None:
    """Files of the vendored tree that differ from what `vendor` wrote (edited, added, removed).

    None for a tree an interrupted `vendor` left half written: it holds no edits of the user
    (vendor starts only on a tree without them), and nothing may be exported from it.
    """
    state = _load_state(root)
    if state is None:
        return []
    if state.get("incomplete"):
        return None
    now = _hash_tree(root, ["megatron"], state["test_files"])
    old: dict[str, str] = state["files"]
    return sorted(p for p in set(now) | set(old) if now.get(p) != old.get(p))


def unexported_edits(root: Path) -> bool | None:
    """Whether the vendored tree differs from what `vendor` (or `export`) last wrote, for the
    `.edited` label of a build: from build/vendor.json, or, where build/ is gone, from the
    digest of its files in megatron/core/_mcore_fixes.json (shipped with it). A tree with
    neither cannot be shown unedited: True. None: half written by an interrupted `vendor`.
    """
    if _load_state(root) is not None:
        edits = local_edits(root)
        return None if edits is None else bool(edits)
    try:
        info = json.loads((root / "megatron" / "core" / INFO_NAME).read_text(encoding="utf-8"))
        recorded = info["files_sha256"]
    except (OSError, ValueError, TypeError, KeyError):
        return True
    return files_digest(_hash_tree(root, ["megatron"], [])) != recorded


def refuse_symlinks(target: Path, within: Path) -> None:
    """UserError where `target` or a folder between `within` and it is a symlink: the tool
    writes only into its own tree, never through a link (e.g. to the user's checkout)."""
    path = within
    for part in target.relative_to(within).parts:
        path = path / part
        if path.is_symlink():
            raise UserError(
                f"{path.relative_to(within.parent).as_posix()} is a symlink (to "
                f"{os.readlink(path)}): mcore_fixes writes only regular files and folders of "
                "its own tree, never through a link; replace it with a regular file or folder "
                "(nothing was written)"
            )


def _load_state(root: Path, strict: bool = True) -> dict | None:
    """build/vendor.json; None if absent (or corrupt and not `strict`)."""
    path = root / "build" / STATE_NAME
    if not path.exists() or not (root / "megatron").exists():
        return None
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        state = None
    if (
        isinstance(state, dict)
        and isinstance(state.get("baseline"), str)
        and isinstance(state.get("test_files"), list)
        and (state.get("incomplete") or isinstance(state.get("files"), dict))
    ):
        return state
    if strict:
        raise UserError(
            f"{path} is corrupt, so the edits of {root / 'megatron'} cannot be told apart; "
            "`vendor --force` rebuilds it (discarding them)"
        )
    return None


def _write_state(root: Path, state: dict) -> None:
    path = root / "build" / STATE_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, path)


def vendor(
    root: Path,
    manifest: Manifest,
    b: Baseline,
    tree: Path,
    force: bool,
    progress: Progress,
    chosen: bool = False,
) -> dict:
    """Apply the series to the pristine tree and install the result as the vendored tree.

    `chosen`: the user named the baseline (`vendor --baseline`); recorded, so that `pip
    install` keeps it on any Python it installs on, where it replaces a default that another
    Python chose (setup.py).

    Interrupt-safe: build/vendor.json says `incomplete` while megatron/ is replaced (by
    renames), so a killed run is redone by the next `vendor` and never exported.
    """
    edits = [] if force else local_edits(root)
    if edits:
        raise CheckFailed(
            f"the vendored tree has {len(edits)} local edit(s) (e.g. {edits[0]}); run "
            "`python -m mcore_fixes export` to keep them, or `vendor --force` to discard them"
        )
    previous = _load_state(root, strict=not force)
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
    old_tests = (previous or {}).get("test_files", [])
    for rel in sorted({"megatron", *old_tests, *tests}):  # before anything is written
        refuse_symlinks(root / rel, root)
    for rel in tests:
        dest = root / rel
        if rel not in old_tests and dest.exists() and not force:
            if not dest.is_file() or dest.read_bytes() != (tree / rel).read_bytes():
                raise CheckFailed(
                    f"{rel} exists, and vendor did not write it: move it away, or pass "
                    "`vendor --force` to replace it (nothing was written)"
                )

    progress.step("writing the vendored tree")
    staging, retired = root / "build" / "vendor-staging", root / "build" / "vendor-retired"
    for leftover in (staging, retired):  # of a killed run
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.copytree(tree / "megatron", staging / "megatron", symlinks=True)
    record["files_sha256"] = files_digest(_hash_tree(staging, ["megatron"], []))
    (staging / "megatron" / "core" / INFO_NAME).write_text(json.dumps(record, indent=2) + "\n")
    (root / "build").mkdir(exist_ok=True)
    _write_state(
        root, {"baseline": b.name, "incomplete": True, "test_files": sorted({*old_tests, *tests})}
    )
    if (root / "megatron").exists():
        os.replace(root / "megatron", retired)
    os.replace(staging / "megatron", root / "megatron")
    for rel in old_tests:
        if rel not in tests:  # the test of a patch not applied on this baseline
            (root / rel).unlink(missing_ok=True)
    for rel in tests:
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / rel, dest, follow_symlinks=False)
    state = {
        "baseline": b.name,
        "chosen": chosen,
        "pin": b.pin,
        "series": series_hashes(manifest, b),
        "test_files": tests,
        "files": _hash_tree(root, ["megatron"], tests),
    }
    _write_state(root, state)
    for leftover in (staging, retired):
        shutil.rmtree(leftover, ignore_errors=True)
    return record


def series_hashes(manifest: Manifest, b: Baseline) -> dict[str, str]:
    """sha256 of every patch file `b` takes (relative to patches/); each must exist and parse.

    A missing or unreadable one is a CheckFailed saying how to get it back; nothing is written.
    """
    hashes: dict[str, str] = {}
    for p in manifest.patches:
        path = manifest.patch_file(b, p)
        if path is None:
            continue
        rel = path.relative_to(manifest.root).as_posix()
        try:
            read_patch(path)
        except UserError as exc:
            raise CheckFailed(
                f"{exc}; restore patches/{rel} (e.g. `git checkout -- patches/{rel}`) and run "
                "again (nothing was written)"
            ) from None
        hashes[rel] = file_sha256(path)
    return hashes


def verify_vendored(root: Path, manifest: Manifest, b: Baseline, tree: Path) -> None:
    """Refuse unless ./megatron is what `vendor` wrote for `b` plus its edits: the recorded
    patch files are the current ones, megatron/core/_mcore_fixes.json names `b` and its pin,
    and build/vendor.json's hashes are `b`'s pristine tree with the series applied (`tree` is
    at that state). Each refusal is one line saying what is wrong and how to recover.
    """
    state = _load_state(root)
    assert state is not None
    again = f"run `python -m mcore_fixes vendor --baseline {b.name}` (with --force to drop edits)"
    if state.get("incomplete"):
        raise CheckFailed(f"an interrupted `vendor` left megatron/ half written; {again}")
    series = series_hashes(manifest, b)
    recorded = state.get("series")
    if recorded is not None and recorded != series:
        changed = sorted(k for k in set(series) | set(recorded) if series.get(k) != recorded.get(k))
        raise CheckFailed(
            f"patches/{changed[0]} changed since megatron/ was vendored, so its edits cannot be "
            f"told from the series: restore it, or {again} (nothing was written)"
        )
    info_path = root / "megatron" / "core" / INFO_NAME
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
        found = f"{info['baseline']} (pin {info['pin']})"
    except (OSError, ValueError, TypeError, KeyError):
        found = "nothing readable"
    if found != f"{b.name} (pin {b.pin})":
        raise CheckFailed(
            f"megatron/ is not the tree vendor wrote: build/{STATE_NAME} says {b.name}, "
            f"megatron/core/{INFO_NAME} says {found}; {again} (nothing was written)"
        )
    if _hash_tree(tree, ["megatron"], state["test_files"]) != state["files"]:
        raise CheckFailed(
            f"build/{STATE_NAME} does not match {b.name} with the series applied (a hand-edited "
            f"or stale record); {again} (nothing was written)"
        )


def replace_all(texts: dict[Path, str], within: Path | None = None) -> None:
    """Write every file of `texts` or none: temp files first, then renames; a failure puts
    the old contents back. A target that is (or lies below) a symlink under `within` is
    refused before anything is written."""
    for target in texts:
        refuse_symlinks(target, within or target.parent)
    old = {t: t.read_bytes() if t.exists() else None for t in texts}
    tmps = {t: t.with_name(t.name + ".tmp") for t in texts}
    try:
        for target, text in texts.items():
            tmps[target].unlink(missing_ok=True)  # a link there is removed, not written through
            tmps[target].write_text(text, encoding="utf-8")
        with git.signals_held():
            done: list[Path] = []
            try:
                for target in texts:
                    os.replace(tmps[target], target)
                    done.append(target)
            except BaseException:
                for target in done:
                    data = old[target]
                    if data is None:
                        target.unlink(missing_ok=True)
                    else:
                        target.write_bytes(data)
                raise
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)


def vendored_choice(root: Path) -> tuple[str, bool] | None:
    """(the vendored baseline, whether the user chose it with `vendor --baseline`), from
    build/vendor.json; None without a readable one. A record written before the choice was
    kept reads as not chosen."""
    state = _load_state(root, strict=False)
    if state is None or state.get("incomplete"):
        return None
    return state["baseline"], bool(state.get("chosen", False))


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
    if edits is None:
        raise CheckFailed(
            f"an interrupted `vendor` left {root / 'megatron'} half written; run "
            f"`python -m mcore_fixes vendor --baseline {b.name}` again (nothing was exported)"
        )
    for rel in edits:  # the patch files are UTF-8 text
        try:
            if (root / rel).is_file():
                (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(
                f"{rel}: not UTF-8 text ({exc.reason} at byte {exc.start}), so it cannot go into "
                "a patch file; fix it and export again (nothing was written)"
            ) from None
    series_hashes(manifest, b)  # every patch file present and parsing, before anything runs
    cells = apply_series(tree, manifest, b)
    verify_vendored(root, manifest, b, tree)
    broken = [c for c in cells if c.state not in OK_STATES + ("absent",)]
    if broken:  # exporting would rewrite the later patches from a different series
        c = broken[0]
        raise CheckFailed(
            f"patch {c.patch} ({c.file}) is {c.state} on {b.name} ({c.detail}); restore it "
            "before exporting (nothing was written)"
        )
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
    new_texts: dict[Path, str] = {}
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
        left_out = [t for t in cell.excluded if t in test_files(read_patch(target))]
        if left_out:  # the commit holds the patch without these sections
            if cell.patch in owners:
                raise CheckFailed(
                    f"{cell.file} has test sections that {b.name} cannot take "
                    f"({'; '.join(f'{t}: {cell.excluded[t]}' for t in left_out)}), so it cannot "
                    "be exported from there; edit it where they apply (a git baseline with "
                    "those test files)"
                )
            results.append((cell.file, "unchanged"))
            continue
        text = git.run(tree, "format-patch", "-1", sha, *git.FORMAT_PATCH_ARGS).stdout
        changed = target.read_text(encoding="utf-8") != text
        if changed:
            new_texts[target] = text
        results.append((cell.file, "updated" if changed else "unchanged"))
    state = _load_state(root)
    assert state is not None
    state["files"] = _hash_tree(root, ["megatron"], state["test_files"])
    replace_all(new_texts, within=manifest.root)  # the patch files change together, or none
    state["series"] = series_hashes(manifest, b)
    _write_state(root, state)
    _record_export(root, manifest)
    return results


def _record_export(root: Path, manifest: Manifest) -> None:
    """The vendored tree's own record after an export: its files are now the series' (no
    `.edited` label, even without build/), and the patch files' hashes are the new ones."""
    path = root / "megatron" / "core" / INFO_NAME
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # verify_vendored read it before: a record gone meanwhile stays gone
    info["files_sha256"] = files_digest(_hash_tree(root, ["megatron"], []))
    for entry in info.get("applied", []):
        entry["sha256"] = file_sha256(manifest.root / entry["file"])
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, path)
