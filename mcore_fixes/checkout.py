"""`apply`: put the series onto a user's Megatron-LM checkout, all or nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import git, sources
from .errors import CheckFailed, UserError
from .manifest import Baseline, Manifest
from .progress import Progress
from .series import (
    LEFT_OUT,
    conflict_detail,
    fit,
    left_out_lines,
    not_carried,
    patch_arg,
    read_patch,
)

_RELEASE_BRANCH = re.compile(r"core_r(\d+\.\d+)\.0")  # upstream's release branches
_VERSION_FIELD = re.compile(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*(.+?)\s*$", re.M)


def toplevel(path: Path) -> Path:
    if not path.exists():
        raise UserError(f"{path} does not exist")
    proc = git.run(path, "rev-parse", "--show-toplevel", check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise UserError(f"{path} is not a git work tree (a clone or a linked worktree)")
    top = Path(proc.stdout.strip())
    if not git.ok(top, "rev-parse", "-q", "--verify", "HEAD^{commit}"):
        raise UserError(f"{top} has no commit yet (an unborn HEAD): check out a Megatron-LM commit")
    return top


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
    """The baseline of a checkout, and how it was found (said to the user).

    In this order: HEAD is a baseline's pinned commit; HEAD's branch (or its upstream) is a
    baseline's ref and HEAD descends from its pin; HEAD descends from pinned commits (the
    nearest wins); the version in megatron/core/package_info.py, where a git baseline (it
    carries upstream's tests) wins over a PyPI one, and a git baseline whose pin is in the
    checkout but on another line of history never matches; then HEAD is an older commit of a
    pinned line; last, HEAD's branch (or its upstream) is the release branch `core_rX.Y.0` of
    a pinned tag `core_vX.Y.*` (a shallow clone, whose history cannot tell). So main at any
    commit never takes the 0.19 variants for saying 0.19.1.
    """
    head = git.out(checkout, "rev-parse", "HEAD")
    pinned = [b for b in manifest.baselines.values() if b.is_git]
    for b in pinned:
        if b.commit == head:
            return b, f"HEAD is the pinned commit of {b.name}"

    after: list[tuple[int, Baseline]] = []
    before: list[tuple[int, Baseline]] = []
    unrelated: set[str] = set()
    for b in pinned:
        if not git.ok(checkout, "cat-file", "-e", f"{b.commit}^{{commit}}"):
            continue  # e.g. a shallow clone: history cannot tell
        if git.ok(checkout, "merge-base", "--is-ancestor", b.commit, head):
            after.append((_count(checkout, f"{b.commit}..{head}"), b))
        elif git.ok(checkout, "merge-base", "--is-ancestor", head, b.commit):
            before.append((_count(checkout, f"{head}..{b.commit}"), b))
        else:
            unrelated.add(b.name)
    branches = _branch_names(checkout)
    for n, b in sorted(after, key=lambda t: t[0]):
        if b.ref and b.ref in branches:
            return b, f"branch {b.ref}, {n} commit(s) after the pinned commit of {b.name}"
    if after:
        n, b = min(after, key=lambda t: t[0])
        return b, f"HEAD is {n} commit(s) after the pinned commit of {b.name}"

    version = package_version(checkout)
    matches = [
        b for b in manifest.baselines.values() if b.version == version and b.name not in unrelated
    ]
    if matches:
        b = sorted(matches, key=lambda b: not b.is_git)[0]
        return b, f"megatron/core/package_info.py says {version}; no pinned commit in its history"
    if before:
        n, b = min(before, key=lambda t: t[0])
        return b, f"HEAD is {n} commit(s) before the pinned commit of {b.name}"
    for name in sorted(branches):  # e.g. a shallow clone of a release branch: history cannot tell
        m = _RELEASE_BRANCH.fullmatch(name)
        tags = [b for b in pinned if m and b.ref.startswith(f"core_v{m.group(1)}.")]
        if tags:
            b = max(tags, key=lambda b: tuple(int(x) for x in re.findall(r"\d+", b.ref)))
            return b, f"branch {name} is the release branch of {b.ref}"
    known = manifest.baselines.values()
    releases = ", ".join(b.name for b in known if not b.is_git) or "none"
    refs = ", ".join(b.name for b in known if b.is_git) or "none"
    raise UserError(
        f"{checkout} (megatron-core {version}, HEAD {head[:10]}) matches no baseline of the "
        f"series. Known releases (PyPI versions): {releases}. Known git baselines (tags and "
        f"branches): {refs}. Pass --baseline NAME (one of these) to choose one explicitly."
    )


def check_override(manifest: Manifest, checkout: Path, chosen: Baseline) -> None:
    """Refuse `--baseline` that contradicts the checkout's history: the wrong variants would
    be committed silently (e.g. core_v0.19.0's on main's pinned commit)."""
    try:
        found, why = detect_baseline(manifest, checkout)
    except UserError:  # nothing to contradict
        return
    if found.name == chosen.name or "package_info.py" in why or "release branch" in why:
        return  # the same, or found by weak evidence only (a version, a branch name)
    files = {p.id: manifest.patch_file(found, p) for p in manifest.patches}
    if all(manifest.patch_file(chosen, p) == files[p.id] for p in manifest.patches):
        return  # the same patch files either way (e.g. a PyPI release and its git tag)
    raise UserError(
        f"--baseline {chosen.name} does not fit {checkout}: {why}, and {found.name} takes "
        f"other patch files; pass --baseline {found.name} or leave --baseline out"
    )


def _count(checkout: Path, spec: str) -> int:
    return int(git.out(checkout, "rev-list", "--count", spec))


def _branch_names(checkout: Path) -> set[str]:
    """HEAD's branch and its upstream, short and without the remote (`origin/dev` -> dev)."""
    names: set[str] = set()
    for spec in ("HEAD", "HEAD@{upstream}"):
        proc = git.run(checkout, "rev-parse", "--abbrev-ref", spec, check=False)
        name = proc.stdout.strip()
        if proc.returncode == 0 and name and name != "HEAD":
            names |= {name, name.split("/", 1)[-1]}
    return names


STATE_DIR = "mcore-fixes"  # inside the checkout's git dir: scratch index and journal
# {"orig": HEAD before, "new": the series' commit, "commit": whether HEAD moves too, "backup":
# the touched files as they were}, while the checkout moves
JOURNAL = "apply.json"
BACKUP = "backup"  # beside the journal: the touched files' bytes before the checkout moved
Todo = list[tuple[str, Path, str, tuple[str, ...]]]  # (patch id, file, text, git apply options)
APPLY = ("apply", "--whitespace=nowarn")  # the user's apply.whitespace=error is for their diffs


APPLY_REFLOG = "mcore_fixes apply"  # HEAD's reflog message: how `unapply` finds the apply
UNAPPLY_REFLOG = "mcore_fixes unapply"


@dataclass
class Outcome:
    report: list[tuple[str, str]]  # (patch id, what happened / would happen)
    touched: list[str] = field(default_factory=list)  # files the series changed (or would)
    staged: str = ""  # the series' commit object, where `apply --no-commit` staged it already


def apply(
    manifest: Manifest, checkout: Path, b: Baseline, commit: bool, dry_run: bool = False
) -> Outcome:
    """Apply every patch of `b` not yet present; report what happened per patch.

    Everything is checked before anything is written: a dirty touched file, staged changes
    (commit mode), an operation in progress or a conflict refuses with the checkout untouched.
    The commits are built as objects first (scratch index, `commit-tree`); the checkout then
    moves in one step (`read-tree -m -u`, `update-ref`), journaled, with SIGINT/SIGTERM held:
    an interrupted run is completed or undone by the next one. Runs are serialized per work
    tree (a lock on its git dir, like the project lock). `dry_run`: the same checks and
    answers, nothing written (scratch index and new objects in a temporary folder).
    """
    gitdir = Path(git.out(checkout, "rev-parse", "--absolute-git-dir"))
    for path in (gitdir, checkout) if not dry_run else ():
        if not os.access(path, os.W_OK):
            raise UserError(f"{path} is not writable: cannot apply the series to {checkout}")
    with sources.project_lock(gitdir, Progress(enabled=True)):
        state = gitdir / STATE_DIR
        if dry_run:
            pending = "an interrupted apply is pending: the next apply completes or undoes it"
            with tempfile.TemporaryDirectory(prefix="mcore-fixes-dry-run-") as tmp:
                odb = _scratch_odb(tmp, checkout)
                outcome = _apply(manifest, checkout, b, commit, Path(tmp), odb)
            if (state / JOURNAL).exists():
                outcome.report.insert(0, ("(recovery)", pending))
            return outcome
        _refuse_git_locks(checkout, "apply")
        recovered, _ = _recover(checkout, state)
        state.mkdir(exist_ok=True)
        try:
            outcome = _apply(manifest, checkout, b, commit, state, {})
        except CheckFailed as exc:
            if recovered:  # said with the refusal, so that it is not lost
                raise CheckFailed(f"{recovered}; then: {exc}") from None
            raise
        finally:
            if not (state / JOURNAL).exists():
                shutil.rmtree(state, ignore_errors=True)
    if recovered:
        outcome.report.insert(0, ("(recovery)", recovered))
    return outcome


class NothingToUndo(CheckFailed):
    """HEAD's reflog holds no `apply` that `unapply` could undo."""

    recovered = ""  # what `unapply` finished or undid of an interrupted run before finding it


def unapply(checkout: Path) -> tuple[str, str, str]:
    """Move HEAD back to where the last `apply` found it; return (HEAD before it, after it,
    what was recovered: "" or a line). Where a killed `unapply` was completed, there is nothing
    more to do: HEAD before it is "".

    The commit `apply` started from is the old value of its own entry in HEAD's reflog (its
    message APPLY_REFLOG), and must be an ancestor of the commit it made. Refused, nothing
    changed, unless HEAD is still the commit `apply` made. The checkout moves as `apply` moved
    it, journaled (`_move`): files the series changed must be unmodified, every other
    uncommitted change, staged or not, stays as it is, and a run killed or interrupted is
    completed or undone by the next `apply` or `unapply`.
    """
    gitdir = _writable_gitdir(checkout, "undo the series in")
    with sources.project_lock(gitdir, Progress(enabled=True)):
        _refuse_git_locks(checkout, "unapply")
        state = gitdir / STATE_DIR
        recovered, finished = _recover(checkout, state)
        try:
            orig, new = _last_apply(checkout)
        except NothingToUndo as exc:
            if finished == "unapply":
                return "", git.out(checkout, "rev-parse", "HEAD"), recovered
            exc.recovered = recovered  # said by the caller, which looks for a staged series
            raise
        touched = git.out(checkout, "diff", "--name-only", "--no-renames", orig, new).splitlines()
        dirty = git.out(checkout, "status", "--porcelain", "--untracked-files=all", "--", *touched)
        if dirty:
            raise CheckFailed(
                f"{checkout} has uncommitted changes in files the series changed; commit or "
                f"stash them first (nothing was changed):\n{dirty}"
            )
        state.mkdir(exist_ok=True)
        try:
            failed, kept = _move(checkout, state, "unapply", new, orig, True, touched)
        finally:
            if not (state / JOURNAL).exists():
                shutil.rmtree(state, ignore_errors=True)
        _refuse_failed(checkout, failed, kept)
    return new, orig, recovered


def _writable_gitdir(checkout: Path, doing: str) -> Path:
    """The checkout's git directory; UserError unless both are writable."""
    gitdir = Path(git.out(checkout, "rev-parse", "--absolute-git-dir"))
    for path in (gitdir, checkout):
        if not os.access(path, os.W_OK):
            raise UserError(f"{path} is not writable: cannot {doing} {checkout}")
    return gitdir


def unapply_staged(manifest: Manifest, checkout: Path, b: Baseline) -> tuple[list[str], str]:
    """Undo `apply --no-commit`: the files the series changed back to HEAD's version in the
    index and the work tree, where both still hold exactly what it staged; every other change,
    staged or not, stays. Return (the files put back, [] where the series is not staged; what
    was recovered: "" or a line). Journaled like `apply` (`_move`, HEAD does not move): a run
    killed or interrupted is completed or undone by the next `apply` or `unapply`. A series
    staged and then edited is refused, nothing changed (CheckFailed naming the files)."""
    gitdir = _writable_gitdir(checkout, "undo the series in")
    with sources.project_lock(gitdir, Progress(enabled=True)):
        _refuse_git_locks(checkout, "unapply")
        state = gitdir / STATE_DIR
        recovered, _ = _recover(checkout, state)
        state.mkdir(exist_ok=True)
        try:
            head = git.out(checkout, "rev-parse", "HEAD")
            outcome = _apply(manifest, checkout, b, False, state, {}, classify_only=True)
            if not outcome.staged:
                return [], recovered
            touched = outcome.touched
            failed, kept = _move(checkout, state, "unapply", outcome.staged, head, False, touched)
        finally:
            if not (state / JOURNAL).exists():
                shutil.rmtree(state, ignore_errors=True)
        _refuse_failed(checkout, failed, kept)
    return touched, recovered


def _refuse_git_locks(checkout: Path, verb: str) -> None:
    """Refuse, nothing changed, where git's lock of the index, HEAD or HEAD's branch exists: a
    git process runs there or was killed. Never removed here: a running git's looks the same."""
    branch = git.run(checkout, "symbolic-ref", "-q", "HEAD", check=False).stdout.strip()
    for name in ("index", "HEAD", *([branch] if branch else [])):
        lock = checkout / git.out(checkout, "rev-parse", "--git-path", f"{name}.lock")
        if lock.exists():
            raise CheckFailed(
                f"{lock} exists: a git process in {checkout} is running or was interrupted; "
                f"if no git process runs there, remove {lock} and run {verb} again (nothing "
                "was changed)"
            )


REFLOG = {"apply": APPLY_REFLOG, "unapply": UNAPPLY_REFLOG}


def _move(
    checkout: Path, state: Path, verb: str, orig: str, new: str, commit: bool, touched: list[str]
) -> tuple[str, list[str]]:
    """Index and work tree from commit `orig` to `new` in one step, then HEAD (if `commit`),
    journaled in `state` with the touched files' bytes, signals held: the files by `read-tree
    -m -u` (refused if a file it changes is modified; other uncommitted work stays as it is),
    then HEAD. If git fails partway (a failing smudge filter, a full disk) or HEAD moved
    meanwhile, the files are put back; a run killed in between is completed or undone by the
    next one (`_recover`). Returns (git's error or "", files changed since that were left as
    they are)."""
    backup = _backup(checkout, state, touched)
    record = {"verb": verb, "orig": orig, "new": new, "commit": commit, "backup": backup}
    (state / "journal.tmp").write_text(json.dumps(record) + "\n")
    os.replace(state / "journal.tmp", state / JOURNAL)
    with git.signals_held():
        proc = git.run(checkout, "read-tree", "-m", "-u", orig, new, check=False)
        if proc.returncode == 0 and commit:
            message = REFLOG[verb]
            ref = git.run(checkout, "update-ref", "-m", message, "HEAD", new, orig, check=False)
            if ref.returncode != 0:  # HEAD moved meanwhile: put the files back
                git.run(checkout, "read-tree", "-m", "-u", new, orig, check=False)
                proc = ref
            else:  # as `git am` and `git reset` do (`unapply` undoes it, keeping uncommitted work)
                git.run(checkout, "update-ref", "ORIG_HEAD", orig, check=False)
        kept = _restore(checkout, state, orig, new, backup) if proc.returncode != 0 else []
        (state / JOURNAL).unlink()
    return (_git_error(proc.stderr) if proc.returncode != 0 else ""), kept


def _refuse_failed(checkout: Path, why: str, kept: list[str]) -> None:
    """CheckFailed where `_move` failed: git's reason, and the files it could not put back."""
    if kept:
        raise CheckFailed(
            f"git failed ({why}) and {checkout} could not be put back fully: "
            f"{', '.join(kept)} changed meanwhile; check them with `git status`"
        )
    if why:
        raise CheckFailed(f"{checkout} left unchanged: git failed: {why}")


def _last_apply(checkout: Path) -> tuple[str, str]:
    """(the commit `apply` started from, the one it made): the old and new values of its own
    entry in HEAD's reflog, the first an ancestor of the second."""
    entries = _reflog(checkout)
    ours = [e for e in entries if e[2].startswith("mcore_fixes ")]
    if not ours or ours[0][2] != APPLY_REFLOG:
        last = "was undone already" if ours else "is not in HEAD's reflog"
        raise NothingToUndo(f"{checkout}: nothing to undo: the last `mcore_fixes apply` {last}")
    orig, new, _ = ours[0]
    head = git.out(checkout, "rev-parse", "HEAD")
    if head != new:
        moved = (
            f"{checkout}: HEAD moved since the series was applied (it made {new[:12]} on "
            f"{orig[:12] or 'an unrecorded commit'}, HEAD is {head[:12]}); nothing was changed"
        )
        if orig and git.ok(checkout, "merge-base", "--is-ancestor", new, head):
            moved += (  # the user's own commits on top of the series: git can take it out
                f". Your commits are on top of it: `git -C {checkout} rebase --onto {orig[:12]} "
                f"{new[:12]}` takes the series out under them, or `git -C {checkout} revert "
                f"--no-edit {orig[:12]}..{new[:12]}` undoes it in new commits"
            )
        raise CheckFailed(moved)
    if not orig or not git.ok(checkout, "merge-base", "--is-ancestor", orig, new):
        raise CheckFailed(
            f"{checkout}: HEAD's reflog says the series was applied on {orig[:12] or 'nothing'}"
            f", which is not an ancestor of the commit it made ({new[:12]}); nothing was changed"
        )
    return orig, new


def _reflog(checkout: Path) -> list[tuple[str, str, str]]:
    """HEAD's reflog, newest first: (old value, new value, message) of each entry."""
    log = checkout / git.out(checkout, "rev-parse", "--git-path", "logs/HEAD")
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:  # no reflog file (another ref storage): entries without their old values
        proc = git.run(checkout, "log", "-g", "--format=%H %gs", "HEAD", check=False)
        news = [(*line.split(" ", 1), "")[:2] for line in proc.stdout.splitlines()]
        return [(news[i + 1][0] if i + 1 < len(news) else "", *e) for i, e in enumerate(news)]
    entries = []
    for line in reversed(lines):  # "OLD NEW IDENTITY TIME ZONE\tMESSAGE"
        values, _, message = line.partition("\t")
        old, _, rest = values.partition(" ")
        entries.append((old, rest.partition(" ")[0], message))
    return entries


def _scratch_odb(tmp: str, checkout: Path) -> dict[str, str]:
    """git environment that writes new objects into `tmp` and reads the checkout's too; no
    opportunistic index refresh (`git status` would rewrite .git/index)."""
    objects = Path(tmp) / "objects"
    objects.mkdir()
    real = (checkout / git.out(checkout, "rev-parse", "--git-path", "objects")).resolve()
    return {
        "GIT_OBJECT_DIRECTORY": str(objects),
        "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(real),
        "GIT_OPTIONAL_LOCKS": "0",
    }


def _recover(checkout: Path, state: Path) -> tuple[str, str]:
    """Finish (or undo) an apply or unapply that was killed while moving the checkout; return
    what was done ("" if nothing) and the verb whose move is now complete ("" if none)."""
    journal = state / JOURNAL
    if not journal.exists():
        shutil.rmtree(state, ignore_errors=True)  # a scratch index of a killed check
        return "", ""
    try:  # written (atomically) before the checkout moves: unreadable means it never moved
        record = json.loads(journal.read_text())
        verb, orig, new = str(record.get("verb", "apply")), str(record["orig"]), str(record["new"])
        commit, backup = bool(record.get("commit", True)), list(record.get("backup", []))
        touched = [str(entry["path"]) for entry in backup]
        message = REFLOG[verb]
    except (ValueError, KeyError, TypeError, AttributeError):
        verb, orig, new, commit, backup, touched, message = "apply", "", "", True, [], [], ""
    head = git.out(checkout, "rev-parse", "HEAD")
    new_tree = git.run(checkout, "rev-parse", "-q", "--verify", f"{new}^{{tree}}", check=False)
    moved = bool(new) and new_tree.returncode == 0 and _index_holds(checkout, new, touched)
    what, finished = f"an interrupted {verb} was undone before it changed anything", ""
    staged = {"apply": "apply --no-commit", "unapply": "unapply of a staged series"}[verb]
    with git.signals_held():
        if moved and (head == orig or not commit):  # git's step was done (HEAD stays if staged)
            finished = verb
            if commit:
                git.run(checkout, "update-ref", "-m", message, "HEAD", new, orig)
                what = f"an interrupted {verb} was completed"
            else:
                what = f"an interrupted {staged} had completed"
        elif new and head == new and commit:
            what, finished = f"an interrupted {verb} had completed", verb
        elif (head == orig or not commit) and backup:  # killed while git wrote the files
            kept = _restore(checkout, state, orig, new, backup)
            what = f"an interrupted {verb if commit else staged} was undone"
            if kept:
                what += f" (changed since, left as they are: {', '.join(kept)})"
        elif head != orig:
            what = f"an interrupted {verb} was found, but HEAD has moved since: left as it is"
        journal.unlink()
    shutil.rmtree(state, ignore_errors=True)
    return what, finished


def _index_holds(checkout: Path, commit: str, touched: list[str]) -> bool:
    """Whether the index holds `commit`'s version of every touched file (of all files, where
    none are named); other staged changes do not count."""
    if touched:
        return git.ok(checkout, "diff", "--cached", "--quiet", commit, "--", *touched)
    tree = git.run(checkout, "write-tree", check=False).stdout.strip()
    return tree == git.out(checkout, "rev-parse", f"{commit}^{{tree}}")


def _apply(
    manifest: Manifest,
    checkout: Path,
    b: Baseline,
    commit: bool,
    state: Path,
    odb: dict[str, str],
    classify_only: bool = False,
) -> Outcome:
    """`odb`: {} (objects into the checkout's repository) or a dry run's `_scratch_odb`.
    `classify_only`: only say whether the series is staged (`Outcome.staged`); write nothing
    but objects."""
    dry_run = bool(odb)
    for marker in ("rebase-apply", "rebase-merge", "MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD"):
        if (checkout / git.out(checkout, "rev-parse", "--git-path", marker)).exists():
            raise CheckFailed(
                f"{checkout}: a git am/rebase/merge/cherry-pick/revert is in progress; "
                "finish or abort it first"
            )

    # Classify each patch against HEAD in a scratch index: the checkout is not touched.
    orig = git.out(checkout, "rev-parse", "HEAD")
    contained = _contained_prefix(manifest, checkout, b, orig, state, odb)
    env = {**odb, "GIT_INDEX_FILE": str(state / "index")}
    git.run(checkout, "read-tree", orig, env=env)
    report: list[tuple[str, str]] = []
    todo: Todo = []
    for p in manifest.patches:
        path = manifest.patch_file(b, p)
        if path is None:
            report.append((p.id, f"absent on {b.name}: {b.absent[p.id]}"))
            continue
        text = read_patch(path)
        whole = p.id in b.fixed_upstream  # applied only if all of it is there
        if p.id in contained or fit(checkout, path, "--cached", "-R", env=env, whole=whole):
            where = manifest.upstream_has(b, p)  # upstream's code there, not an earlier apply
            report.append((p.id, f"already in {b.name}: {where}" if where else "already applied"))
            continue
        opts, left_out = fit(checkout, path, "--cached", env=env) or ((), {})
        proc = git.run(checkout, *APPLY, "--cached", *opts, patch_arg(path), check=False, env=env)
        if proc.returncode != 0 and p.id in b.fixed_upstream:  # the rest of the series goes on
            report.append((p.id, f"fixed upstream ({b.fixed_upstream[p.id]}), skipped"))
            continue
        if proc.returncode != 0:
            raise CheckFailed(
                f"patch {p.id} ({path.name}) {conflict_detail(proc.stderr)}; "
                f"{checkout} was left unchanged"
            )
        left_out = {**left_out, **not_carried(manifest, p, path, text)}
        report += [(p.id, line) for line in left_out_lines(p.id, left_out)]
        todo.append((p.id, path, text, opts))
    if not todo:
        return Outcome(report)

    touched = sorted({t for _, _, text, _ in todo for t in git.touched_paths(text)})
    new = _commit_chain(checkout, orig, todo, state, odb)  # objects only: checkout untouched
    _refuse_what_is_in_the_way(checkout, orig, new, touched, odb)
    dirty = git.out(
        checkout, "status", "--porcelain", "--untracked-files=all", "--", *touched, env=odb
    )
    if dirty:
        if _staged(checkout, new, touched, odb):
            if not commit:
                how = "already applied (staged, not committed)"
                return Outcome(_ordered(manifest, report, todo, how), touched, staged=new)
            raise CheckFailed(
                f"{checkout}: the series is applied but not committed (apply --no-commit?): "
                f"`git commit` it, or undo it (python -m mcore_fixes unapply {checkout}), "
                "then run again"
            )
        raise CheckFailed(
            f"{checkout} has uncommitted changes in files the series touches; commit or stash "
            f"them first (nothing was changed):\n{dirty}"
        )
    if classify_only:
        return Outcome(report, touched)
    if commit and not git.ok(checkout, "diff", "--cached", "--quiet", env=odb):
        raise CheckFailed(f"{checkout} has staged changes; commit or unstage them first")
    changed = git.out(checkout, "diff", "--name-only", orig, new, env=odb).splitlines()
    if dry_run:
        how = "would be committed" if commit else "would be staged (not committed)"
        return Outcome(_ordered(manifest, report, todo, how, manifest.root), changed)

    # The series' tree into the index and work tree in one step (`read-tree -m -u`), then HEAD
    # (unless --no-commit). Journaled with the touched files' bytes: if git fails partway (a
    # failing smudge filter, a full disk) or the run is killed, they are put back.
    why, kept = _move(checkout, state, "apply", orig, new, commit, touched)
    _refuse_failed(checkout, why, kept)
    if not commit:
        how = "staged in the index and work tree (not committed)"
        return Outcome(_ordered(manifest, report, todo, how), changed)
    return Outcome(_ordered(manifest, report, todo, "committed"), changed)


def _git_error(stderr: str) -> str:
    """git's reason in one line: its `fatal:` line, else its last line."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    fatal = [ln for ln in lines if ln.startswith("fatal:")]
    return (fatal or lines or ["no message"])[-1]


def _refuse_what_is_in_the_way(
    checkout: Path, orig: str, new: str, touched: list[str], odb: dict[str, str]
) -> None:
    """Refuse (as `git am` does) where a file the series creates exists untracked or ignored,
    or a directory on its way is a symlink or a file: git would overwrite or write through it."""

    def names(*args: str) -> set[str]:
        return set(_nul(git.run(checkout, *args, "--", *touched, env=odb).stdout))

    tracked = names("ls-files", "-z") | names("ls-tree", "-r", "-z", "--name-only", orig)
    created = sorted(names("ls-tree", "-r", "-z", "--name-only", new) - tracked)
    for rel in created:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            up = checkout.joinpath(*parts[:i])
            if up.is_symlink() or (up.exists() and not up.is_dir()):
                kind = "a symlink" if up.is_symlink() else "a file"
                raise CheckFailed(
                    f"{checkout}: the series creates {rel}, but {'/'.join(parts[:i])} is {kind} "
                    "here (git would write through it or replace it); move it away first "
                    "(nothing was changed)"
                )
        if os.path.lexists(checkout / rel):
            ignored = git.ok(checkout, "check-ignore", "-q", "--no-index", "--", rel)
            raise CheckFailed(
                f"{checkout}: the series creates {rel}, which exists here "
                f"({'ignored' if ignored else 'untracked'}); move it away first (nothing was "
                "changed)"
            )


def _nul(text: str) -> list[str]:
    return [p for p in text.split("\0") if p]


def _backup(checkout: Path, state: Path, touched: list[str]) -> list[dict]:
    """The touched files as they are (bytes in state/backup/, mode, or absent), and the
    directories the series would create, so that `_restore` can put them back."""
    folder = state / BACKUP
    folder.mkdir()
    entries: list[dict] = []
    for n, rel in enumerate(touched):
        path = checkout / rel
        entry: dict = {"path": rel}
        if path.is_symlink():
            entry["link"] = os.readlink(path)
        elif path.is_file():
            shutil.copyfile(path, folder / str(n))
            entry |= {"file": str(n), "mode": path.stat().st_mode & 0o7777}
        else:
            parent = path.parent
            missing = []
            while parent != checkout and not os.path.lexists(parent):
                missing.append(parent.relative_to(checkout).as_posix())
                parent = parent.parent
            entry["dirs"] = missing
        entries.append(entry)
    return entries


def _restore(checkout: Path, state: Path, orig: str, new: str, backup: list[dict]) -> list[str]:
    """Put the touched files back as `_backup` saw them, where they are still what the tool
    wrote (the series' content, or missing); a file changed since otherwise is left as it is
    and returned. The index goes back to `orig` if git left it elsewhere."""
    blobs = {}
    listing = git.run(checkout, "ls-tree", "-r", "-z", new, "--", *[e["path"] for e in backup])
    for line in _nul(listing.stdout):
        meta, _, rel = line.partition("\t")
        blobs[rel] = meta.split()[-1]
    kept: list[str] = []
    dirs: set[str] = set()
    for entry in backup:
        rel, path = entry["path"], checkout / entry["path"]
        dirs.update(entry.get("dirs", []))
        if _same(path, entry, state):
            continue
        if os.path.lexists(path) and not _written_by_git(checkout, rel, path, blobs.get(rel)):
            kept.append(rel)
            continue
        if os.path.lexists(path) or path.is_symlink():
            path.unlink()
        if "link" in entry:
            os.symlink(entry["link"], path)
        elif "file" in entry:
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(state / BACKUP / entry["file"], path)
            path.chmod(entry["mode"])
    for rel in sorted(dirs, key=len, reverse=True):  # the ones git made, if left empty
        try:
            (checkout / rel).rmdir()
        except OSError:
            pass
    paths = [entry["path"] for entry in backup]
    if paths and not _index_holds(checkout, orig, paths):  # the index's other entries stay
        git.run(checkout, "reset", "-q", orig, "--", *paths, check=False)
    git.run(checkout, "update-index", "-q", "--refresh", check=False)
    return kept


def _same(path: Path, entry: dict, state: Path) -> bool:
    """Whether `path` is as the backup `entry` recorded it."""
    if "link" in entry:
        return path.is_symlink() and os.readlink(path) == entry["link"]
    if "file" in entry:
        return (
            path.is_file()
            and not path.is_symlink()
            and path.read_bytes() == (state / BACKUP / entry["file"]).read_bytes()
            and path.stat().st_mode & 0o7777 == entry["mode"]
        )
    return not os.path.lexists(path)


def _written_by_git(checkout: Path, rel: str, path: Path, blob: str | None) -> bool:
    """Whether the file at `path` is the series' blob (as git writes it, with or without the
    checkout's filters)."""
    if blob is None or path.is_symlink() or not path.is_file():
        return False
    for args in (("--no-filters",), (f"--path={rel}",)):
        proc = git.run(checkout, "hash-object", *args, "--", patch_arg(path), check=False)
        if proc.returncode == 0 and proc.stdout.strip() == blob:
            return True
    return False


def _staged(checkout: Path, new: str, touched: list[str], odb: dict[str, str]) -> bool:
    """Whether the index and work tree already hold the series' files (`apply --no-commit`)."""
    return git.ok(checkout, "diff", "--cached", "--quiet", new, "--", *touched, env=odb) and git.ok(
        checkout, "diff", "--quiet", "--", *touched, env=odb
    )


def _contained_prefix(
    manifest: Manifest, checkout: Path, b: Baseline, orig: str, state: Path, odb: dict[str, str]
) -> set[str]:
    """The patches of the longest leading part of the series that `orig` already contains.

    A later patch may change lines an earlier one wrote, so an applied series reverse-applies
    only as a whole, last patch first (each patch alone need not). Patches upstream fixed its
    own way (not in the tree) are stepped over.
    """
    chain = [(p, path) for p in manifest.patches if (path := manifest.patch_file(b, p))]
    env = {**odb, "GIT_INDEX_FILE": str(state / "index-prefix")}
    for k in range(len(chain), 0, -1):
        git.run(checkout, "read-tree", orig, env=env)
        undone: set[str] = set()
        for p, path in reversed(chain[:k]):
            patch_id, whole = p.id, p.id in b.fixed_upstream  # left-out tests stay out
            found = fit(checkout, path, "--cached", "-R", env=env, whole=whole)
            opts = found[0] if found is not None else ()
            if found is not None and git.ok(
                checkout, *APPLY, "--cached", "-R", *opts, patch_arg(path), env=env
            ):
                undone.add(patch_id)
            elif patch_id not in b.fixed_upstream:
                break
        else:
            if undone:
                return undone
    return set()


def _commit_chain(checkout: Path, parent: str, todo: Todo, state: Path, odb: dict[str, str]) -> str:
    """One commit object per patch (author, date and message as `git am` takes them)."""
    identity = {} if git.ok(checkout, "var", "GIT_COMMITTER_IDENT") else git.TOOL_IDENTITY
    index = {**odb, "GIT_INDEX_FILE": str(state / "index")}
    git.run(checkout, "read-tree", parent, env=index)
    for _, path, text, opts in todo:
        msg = state / "msg"
        info = git.run(
            checkout, "mailinfo", "-u", str(msg), os.devnull, env=index, input=text.encode()
        ).stdout
        fields = dict(line.split(": ", 1) for line in info.splitlines() if ": " in line)
        body = f"{fields.get('Subject', '')}\n\n{msg.read_text(encoding='utf-8')}"
        message = git.run(checkout, "stripspace", input=body.encode()).stdout
        git.run(checkout, *APPLY, "--cached", *opts, patch_arg(path), env=index)
        tree = git.out(checkout, "write-tree", env=index)
        author = {
            "GIT_AUTHOR_NAME": fields.get("Author", ""),
            "GIT_AUTHOR_EMAIL": fields.get("Email", ""),
            "GIT_AUTHOR_DATE": fields.get("Date", ""),
        }
        parent = git.run(
            checkout,
            "commit-tree",
            tree,
            "-p",
            parent,
            env={**odb, **identity, **author},
            input=message.encode(),
        ).stdout.strip()
    return parent


def _ordered(
    manifest: Manifest,
    report: list[tuple[str, str]],
    todo: Todo,
    how: str,
    files_under: Path | None = None,
) -> list[tuple[str, str]]:
    """The report in series order; `files_under`: name each patch file (relative to it)."""
    if files_under is None:
        report = report + [(patch_id, how) for patch_id, *_ in todo]
    else:
        report = report + [
            (patch_id, f"{how} (patches/{path.relative_to(files_under).as_posix()})")
            for patch_id, path, *_ in todo
        ]
    order = [p.id for p in manifest.patches]
    return sorted(report, key=lambda r: (order.index(r[0]), r[1].startswith(LEFT_OUT)))
