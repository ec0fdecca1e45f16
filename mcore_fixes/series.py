"""Applying the series to a baseline tree repository: one commit per patch, a state per cell."""

from __future__ import annotations

import atexit
import functools
import hashlib
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from . import git
from .errors import UserError
from .manifest import Baseline, Manifest, Patch

# megatron/ and upstream's unit tests; never tests/tool, tests/proofs, ... of this repository.
ALLOWED_ROOTS = ("megatron/", "tests/unit_tests/")
REGULAR_MODES = ("100644", "100755")  # no symlink (120000), no submodule (160000)
_MODE_LINE = re.compile(
    r"^(?:(?:new file|deleted file|old|new) mode|index [0-9a-f]+\.\.[0-9a-f]+) (\d+)$", re.M
)
_DIFFSTAT = re.compile(r"^ (\d+) files? changed", re.M)

# Cell states.
APPLIES = "applies"
UPSTREAM = "applied-upstream"
FIXED = "fixed-upstream"  # does not apply, but upstream fixed it its own way (proof passes)
ABSENT = "absent"
CONFLICT = "conflict"
SKIPPED = "skipped"
MISSING = "missing"  # the manifest names a patch file that does not exist (yet)
OK_STATES = (APPLIES, UPSTREAM, FIXED)
# README's releases of a fix come from the manifest (mcore_fixes/maint/affected.py): a patch
# found in a baseline's code must be recorded there too
UNRECORDED = "the manifest does not record it: add it to this baseline's applied-upstream table"


@dataclass
class Cell:
    patch: str
    baseline: str
    state: str
    file: str = ""  # patch file, relative to patches/
    detail: str = ""
    commit: str = ""  # commit of the patch in the tree repository (state "applies")
    base: str = ""  # the tree's commit just before this patch (its proof's `before` state)
    proof: dict = field(default_factory=dict)
    # tests/ paths of the patch left out -> why: the tree has no upstream tests (a PyPI sdist),
    # or this baseline's test file differs from the one the section was written against
    excluded: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict:
        hidden = ("commit", "base")
        data = {k: v for k, v in vars(self).items() if k not in hidden and v not in ("", {}, [])}
        return data


def patch_bytes(path: Path) -> bytes:
    """A patch file's bytes as git wrote them. A file whose every line ends in CRLF was
    converted on checkout (a clone with core.autocrlf=true, before .gitattributes kept patch
    files byte-exact): it is read back with LF. (A patch of a file with CRLF lines has LF
    headers, so it is never taken for one.) UserError, in one line, where it cannot be read."""
    return _lf(_read(path))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"patch file not found: {path}") from None
    except OSError as exc:  # a directory, unreadable, ...
        raise UserError(f"{path}: cannot read the patch file ({exc.strerror})") from None


def _lf(data: bytes) -> bytes:
    if b"\r\n" in data and data.count(b"\n") == data.count(b"\r\n"):
        return data.replace(b"\r\n", b"\n")
    return data


def patch_text(path: Path) -> str:
    """A patch file's text (`patch_bytes`, UTF-8); UserError, in one line, where it cannot be
    read or is not UTF-8 text."""
    try:
        return patch_bytes(path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not a text patch ({exc.reason} at byte {exc.start})") from None


_LF_COPIES: dict[str, Path] = {}  # sha256 of the LF bytes -> their copy (see patch_arg)
_LF_LOCK = threading.Lock()


@functools.cache
def _lf_folder() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="mcore-fixes-lf-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def patch_arg(path: Path) -> str:
    """`path` as an argument of `git apply` / `git am`: the file itself, or for a patch file
    checked out with CRLF line ends, a copy with LF (`patch_bytes`) in a private temporary
    folder that is removed when the tool exits."""
    raw = _read(path)
    data = _lf(raw)
    if data == raw:
        return str(path)
    key = hashlib.sha256(data).hexdigest()
    with _LF_LOCK:
        if key not in _LF_COPIES:
            _LF_COPIES[key] = _lf_folder() / f"{key[:16]}-{path.name}"
            _LF_COPIES[key].write_bytes(data)
        return str(_LF_COPIES[key])


def read_patch(path: Path) -> str:
    """Read a patch file and check its shape; UserError for corrupt or out-of-scope patches."""
    text = patch_text(path)
    paths = git.touched_paths(text)
    if not paths:
        raise UserError(f"{path}: corrupt patch: no `diff --git` section found")
    # git's own reading of the patch: parse errors, and every path it would touch (also those
    # of plain `---`/`+++` sections and quoted names, which `diff --git a/` parsing misses).
    # Run outside any repository: inside one, git apply ignores paths outside the cwd.
    with tempfile.TemporaryDirectory() as neutral:
        env = {**git.NEUTRAL_CONFIG, "GIT_CEILING_DIRECTORIES": str(Path(neutral).parent)}
        args = ("apply", "--numstat", "-z", "-")
        stat = git.run(Path(neutral), *args, check=False, env=env, input=text.encode())
    if stat.returncode != 0:
        first = (stat.stderr.strip().splitlines() or ["git apply failed"])[0]
        raise UserError(f"{path}: corrupt patch: {first}")
    for entry in stat.stdout.split("\0"):
        name = entry.split("\t")[-1]
        if name and name not in paths:
            paths.append(name)
    outside = [p for p in paths if not _in_scope(p)]
    if outside:
        raise UserError(
            f"{path}: patch touches paths outside megatron/ and tests/unit_tests/: {outside}"
        )
    diff = text[text.find("\ndiff --git ") :]
    modes = sorted({m for m in _MODE_LINE.findall(diff) if m not in REGULAR_MODES})
    if modes:
        raise UserError(f"{path}: patch creates a symlink or submodule (mode {', '.join(modes)})")
    if not text.startswith("From ") or "\nSubject: " not in text:
        raise UserError(f"{path}: not a `git format-patch` file (no From/Subject header)")
    stat_line = _DIFFSTAT.search(text[: len(text) - len(diff)])
    sections = text.count("\ndiff --git ")
    if stat_line and int(stat_line.group(1)) != sections:
        raise UserError(
            f"{path}: truncated patch: its diffstat lists {stat_line.group(1)} files, "
            f"it has {sections} `diff --git` sections"
        )
    return text


def _in_scope(rel: str) -> bool:
    parts = rel.split("/")
    return rel.startswith(ALLOWED_ROOTS) and not {"", ".", ".."} & set(parts)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def diff_sha256(path: Path) -> str:
    """sha256 of a patch's diff alone: a proof stays valid when only the message changes."""
    text = path.read_bytes()
    start = text.find(b"\ndiff --git ")
    return hashlib.sha256(text[start + 1 :] if start >= 0 else text).hexdigest()


def conflict_detail(stderr: str) -> str:
    """`path:line` of the first failing hunk, or git's first error line."""
    m = re.search(r"patch failed: (\S+)", stderr)
    if m:
        return f"does not apply at {m.group(1)}"
    m = re.search(r"error: (\S+): (does not exist in index|No such file or directory)", stderr)
    if m:
        return f"target file missing: {m.group(1)}"
    m = re.search(r"error: (\S+): already exists in (index|working directory)", stderr)
    if m:
        return f"it creates {m.group(1)}, which exists here"
    first = stderr.strip().splitlines()[:1]
    return first[0] if first else "does not apply"


NO_TESTS_OPTS = ("--exclude=tests/*",)
NO_TESTS_WHY = "this tree has no upstream tests/ (a PyPI sdist)"
Fit = tuple[tuple[str, ...], dict[str, str]]  # (git apply options, left-out test path -> why)


def fit(
    repo: Path, path: Path, *args: str, env: dict[str, str] | None = None, whole: bool = False
) -> Fit | None:
    """How patch `path` applies to `repo` (`git apply ARGS`, e.g. --cached, -R): the options that
    leave out its test sections that do not apply here, each with why; None when its code does
    not apply. Code sections are never left out; a test section only where it does not apply
    as a whole (a release tag's test file differs from the one it was written against).
    `whole`: the patch as a whole or None (a patch upstream fixed its own way is "applied"
    only if all of it reverse-applies).
    """
    apply = ("apply", "--whitespace=nowarn", *args)
    arg = patch_arg(path)
    if whole:
        return ((), {}) if git.ok(repo, *apply, "--check", arg, env=env) else None
    tests = test_files(patch_text(path))  # cheaply: the callers check it with read_patch()
    code = (*apply, "--check", *NO_TESTS_OPTS, arg)
    if "-R" in args and tests and not git.ok(repo, *code, env=env):
        return None  # the usual answer backwards (not applied yet): one git call
    if git.ok(repo, *apply, "--check", arg, env=env):
        return (), {}
    if not tests or ("-R" not in args and not git.ok(repo, *code, env=env)):
        return None
    left_out: dict[str, str] = {}
    for rel in tests:
        one = git.run(repo, *apply, "--check", f"--include={rel}", arg, check=False, env=env)
        if one.returncode != 0:
            left_out[rel] = conflict_detail(one.stderr)
    opts = tuple(f"--exclude={rel}" for rel in left_out)
    if not left_out or not git.ok(repo, *apply, "--check", *opts, arg, env=env):
        return None
    return opts, left_out


LEFT_OUT_TRAILER = "Left-out-test: "  # `Left-out-test: <path> (<why>)`, written by graft-tests


def not_carried(manifest: Manifest, p: Patch, path: Path, text: str) -> dict[str, str]:
    """Tests the variant `path` (`text`) does not carry, each with why, so that they are said
    left out, never dropped silently: every test file of the canonical patch where the variant
    is code only, else those its message names in `Left-out-test:` trailers."""
    canonical = manifest.root / p.file
    if path == canonical or not canonical.is_file():
        return {}
    header = text[: text.find("\ndiff --git ")]
    named = dict(
        line[len(LEFT_OUT_TRAILER) :].partition(" ")[::2]
        for line in header.splitlines()
        if line.startswith(LEFT_OUT_TRAILER)
    )
    if test_files(text) or named:
        return {t: why.strip("()") for t, why in named.items()}
    why = f"{path.parent.name}/{path.name} carries only code, no test section for this baseline"
    return dict.fromkeys(test_files(read_patch(canonical)), why)


LEFT_OUT = "kept the fix, skipped its upstream test in "


def left_out_lines(patch_id: str, excluded: dict[str, str]) -> list[str]:
    """One line per test section of `patch_id` that was left out, saying why: the fix (its code)
    is in; only its edit of an upstream test file is not."""
    return [f"{LEFT_OUT}{rel}: {_said(rel, why)}" for rel, why in excluded.items()]


def _said(rel: str, why: str) -> str:
    """`does not apply at tests/x.py:239` (git's words) in the user's: that file differs here."""
    m = re.fullmatch(r"does not apply at (\S+?):(\d+)", why)
    if m and m.group(1) == rel:
        return (
            "this baseline's copy of that file differs from the one the test was written "
            f"against (at line {m.group(2)})"
        )
    return why


def has_upstream_tests(tree: Path) -> bool:
    """A PyPI sdist has no tests/: there a patch's edits of upstream's test files cannot apply."""
    return (tree / "tests" / "unit_tests").is_dir()


def reset_to_pristine(tree: Path) -> None:
    """Back to the `pristine` tag, whatever a killed run left (am/rebase state, lock files).

    Only under the project lock (no other git runs in the tool's trees), so a lock file here
    is stale: removing it is safe.
    """
    gitdir = tree / ".git"
    for stale in ("rebase-apply", "rebase-merge"):  # an interrupted `git am` or `export`
        shutil.rmtree(gitdir / stale, ignore_errors=True)
    for lock in [*gitdir.glob("*.lock"), *(gitdir / "refs").rglob("*.lock")]:
        lock.unlink(missing_ok=True)
    git.run(tree, "reset", "-q", "--hard", "pristine")
    git.run(tree, "clean", "-q", "-fdx")


def apply_series(
    tree: Path, manifest: Manifest, b: Baseline, only: list[str] | None = None
) -> list[Cell]:
    """Reset `tree` to pristine and `git am` the series in order; return one cell per patch.

    A patch that reverse-applies is `applied-upstream` and is not applied again; one that does
    not apply where the manifest records upstream's own fix (`fixed-upstream`) is skipped and
    counts as present for the patches that require it (prove checks that claim); so does an
    `absent` one (its target code is not in this baseline: the variant of a patch that requires
    it stands without it there); a patch whose required patch did not apply is a conflict.
    `only` limits application to those patch ids
    (and what they require); the other cells are still reported as `skipped`.
    """
    reset_to_pristine(tree)
    no_tests = not has_upstream_tests(tree)
    wanted = _closure(manifest, only) if only else None
    cells: list[Cell] = []
    good: set[str] = set()
    for p in manifest.patches:
        cell = Cell(patch=p.id, baseline=b.name, state=CONFLICT)
        cells.append(cell)
        path = manifest.patch_file(b, p)
        if path is None:
            cell.state, cell.detail = ABSENT, b.absent[p.id]
            good.add(p.id)
            continue
        cell.file = str(path.relative_to(manifest.root))
        if wanted is not None and p.id not in wanted:
            cell.state, cell.detail = SKIPPED, "not selected"
            continue
        if not path.exists():
            cell.state, cell.detail = MISSING, "patch file not written yet"
            continue
        cell.base = git.out(tree, "rev-parse", "HEAD")
        missing = [r for r in p.requires if r not in good]
        if missing:
            cell.detail = f"requires {', '.join(missing)}, which did not apply"
            continue
        text, arg = read_patch(path), patch_arg(path)
        opts: tuple[str, ...] = ()
        excluded: dict[str, str] = {}
        if no_tests and not git.ok(tree, "apply", "--check", arg):
            # Upstream's tests are not in this tree: take the patch's code only, so a patch may
            # edit upstream's existing test files (our CPU proofs live in tests/proofs/).
            opts, excluded = NO_TESTS_OPTS, dict.fromkeys(test_files(text), NO_TESTS_WHY)
        elif not no_tests and (found := fit(tree, path)) is not None:
            opts, excluded = found  # test sections this tag's test files cannot take
        if not no_tests:
            excluded = {**excluded, **not_carried(manifest, p, path, text)}
        if (
            git.ok(tree, "apply", "-R", "--check", *opts, arg)
            if no_tests
            else fit(tree, path, "-R", whole=p.id in b.fixed_upstream) is not None
        ):
            where = manifest.upstream_has(b, p)
            cell.state = UPSTREAM
            cell.detail = (
                f"already in this baseline: {where}"
                if where
                else f"reverse-applies: already in this baseline ({UNRECORDED})"
            )
            good.add(p.id)
            continue
        check = git.run(tree, "apply", "--check", *opts, arg, check=False)
        if check.returncode != 0:
            cell.detail = conflict_detail(check.stderr)
            if p.id in b.fixed_upstream:  # skipped, the rest of the series goes on
                cell.state = FIXED
                cell.detail = f"Applied-Upstream: {b.fixed_upstream[p.id]} (patch {cell.detail})"
                good.add(p.id)
            continue
        git.run(tree, "am", "-q", "--keep-cr", *opts, arg, env=git.TOOL_IDENTITY)
        cell.excluded = excluded
        cell.state = APPLIES
        cell.commit = git.out(tree, "rev-parse", "HEAD")
        good.add(p.id)
    return cells


def _closure(manifest: Manifest, only: list[str]) -> set[str]:
    wanted: set[str] = set()
    for patch_id in only:
        stack = [manifest.patch(patch_id)]
        while stack:
            p: Patch = stack.pop()
            if p.id not in wanted:
                wanted.add(p.id)
                stack.extend(manifest.patch(r) for r in p.requires)
    return wanted


def test_files(patch_text: str) -> list[str]:
    """The regression-test files a patch carries (paths under tests/)."""
    return [p for p in git.touched_paths(patch_text) if p.startswith("tests/")]
