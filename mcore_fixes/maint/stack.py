"""The patch files are the series as stacked, and each commit stands alone (`lint-patches`).

Three checks per baseline, on its effective series (the patch files that apply there, in
order: canonical patches and variants, without absent and fixed-upstream ones):

- ``index``: the blob hashes of format-patch's ``index <pre>..<post>`` lines chain: patch k's
  pre-image of file F is the post-image of the last earlier patch touching F, or, for the first
  one, the baseline's pristine F (where its tree is at hand). Needs no checkout: a patch file
  exported from another stack (one without an earlier patch's edits of F) is caught from the
  patch files alone. tests/ files count on git baselines only (a PyPI sdist has no tests/).
- ``export``: what `export` would write with no edits (``git format-patch`` of each commit of
  the applied series) is byte for byte the patch file this baseline owns.
- ``alone``: each patch applies (code and tests) on the pristine tree plus exactly its declared
  ``requires`` (and theirs), in series order; where it does not, each earlier patch is tried to
  name the hidden dependency. There, ``names``: every Python file it touches compiles and uses
  no global name bound nowhere (a test reusing a class only an earlier patch adds; stdlib
  `symtable`, no torch needed); ``collect``: its test files import and are collected by pytest
  (where an interpreter with torch is at hand and the tree has upstream's tests; a test file
  importing a module this interpreter lacks, such as transformer_engine, is skipped, said so).
"""

from __future__ import annotations

import builtins
import io
import os
import re
import subprocess
import symtable
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import git
from ..manifest import Baseline, Manifest
from ..series import (
    APPLIES,
    NO_TESTS_OPTS,
    Cell,
    conflict_detail,
    patch_arg,
    read_patch,
    test_files,
)
from .pytests import pytest_command

ZERO = re.compile(r"^0+$")
_INDEX = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)(?: \d+)?$")


@dataclass(frozen=True)
class Blobs:
    """One file section of a patch: the blobs before and after (abbreviated; zeros: none)."""

    path: str
    pre: str
    post: str


def index_lines(patch_text: str) -> list[Blobs]:
    """Per `diff --git` section of a format-patch file, its path and `index` blob hashes."""
    found: list[Blobs] = []
    path = ""
    for line in patch_text.splitlines():
        if line.startswith("diff --git a/"):
            path = line.partition(" b/")[2]
        elif path and (m := _INDEX.match(line)):
            found.append(Blobs(path, m.group(1), m.group(2)))
            path = ""
    return found


def _same(a: str, b: str) -> bool:
    if ZERO.match(a) or ZERO.match(b):
        return bool(ZERO.match(a)) and bool(ZERO.match(b))
    n = min(len(a), len(b))
    return n >= 7 and a[:n] == b[:n]


def _short(blob: str) -> str:
    return "(none)" if ZERO.match(blob) else blob[:12]


def blob_chain(
    series: list[tuple[str, str]],
    pristine: dict[str, str] | None,
    with_tests: bool,
    owned: set[str] | None = None,
    actual: dict[tuple[str, str], str] | None = None,
) -> dict[str, list[str]]:
    """Per patch id of `series` ((id, patch text) in order), where its pre-images break the chain.

    `pristine`: path -> blob of the baseline's pristine tree (None: no tree at hand, the first
    patch touching a file is not checked); `with_tests`: check tests/ files too. `owned`: the
    patches whose files this baseline's export writes (None: all); only they are judged, and a
    file another one (a canonical patch on an older baseline) touched last is unknown, unless
    `actual` ((id, path) -> blob just before that patch in the applied stack) says it.
    """
    last: dict[str, tuple[str, str]] = {}  # path -> (post blob or "" if unknown, patch id)
    problems: dict[str, list[str]] = {}
    for patch_id, text in series:
        mine = problems.setdefault(patch_id, [])
        judged = owned is None or patch_id in owned
        for s in index_lines(text):
            if s.path.startswith("tests/") and not with_tests:
                continue
            if s.path in last:
                want, source = last[s.path][0], f"what {last[s.path][1]} leaves"
            elif pristine is not None:
                want, source = pristine.get(s.path, "0"), "the pristine file"
            else:
                want = source = ""
            if actual is not None and (patch_id, s.path) in actual:
                want = actual[(patch_id, s.path)]
            if judged and want and not _same(s.pre, want):
                mine.append(
                    f"{s.path}: pre-image {_short(s.pre)} is not {source} ({_short(want)}): "
                    "exported from another stack"
                )
            last[s.path] = (s.post if judged else "", patch_id)
    return problems


def stack_blobs(tree: Path, cells: list[Cell]) -> dict[tuple[str, str], str]:
    """(patch id, path) -> blob of the path just before the patch in the applied stack ("0":
    absent), for every path of every applied patch."""
    found: dict[tuple[str, str], str] = {}
    for c in cells:
        if c.state != APPLIES:
            continue
        paths = git.out(tree, "diff-tree", "--no-commit-id", "--name-only", "-r", c.commit).split()
        listing = git.out(tree, "ls-tree", "-r", c.base, "--", *paths) if paths else ""
        have = {ln.partition("\t")[2]: ln.split()[2] for ln in listing.splitlines()}
        for path in paths:
            found[(c.patch, path)] = have.get(path, "0")
    return found


def effective_series(m: Manifest, b: Baseline, cells: list[Cell] | None) -> list[tuple[str, Path]]:
    """(patch id, file) of the patches that apply on `b`, in order: from `cells` (the series
    applied to its tree) where at hand, else from the manifest (no absent, none that upstream has
    already: fixed-upstream, applied-upstream, or carried from the branch `b` follows)."""
    if cells is not None:
        return [(c.patch, m.root / c.file) for c in cells if c.state == APPLIES]
    found = []
    for p in m.patches:
        path = m.patch_file(b, p)
        if path is not None and not m.upstream_has(b, p) and path.exists():
            found.append((p.id, path))
    return found


def owned_ids(m: Manifest, b: Baseline) -> set[str]:
    """The patches whose files `export` on `b` writes: its variants; every one on canonical."""
    if b.name == m.canonical:
        return {p.id for p in m.patches}
    return {p.id for p in m.patches if p.id in b.variants}


def owned(m: Manifest, b: Baseline, cell: Cell) -> bool:
    """Whether `export` on `b` writes this cell's patch file (the rule of vendor.export)."""
    return b.variants.get(cell.patch) == cell.file or b.name == m.canonical


def export_drift(tree: Path, m: Manifest, b: Baseline, cells: list[Cell]) -> dict[str, str]:
    """Per patch whose file `export` with no edits would rewrite on `b`: how (first diff line)."""
    drift: dict[str, str] = {}
    for cell in cells:
        if cell.state != APPLIES or cell.excluded or not owned(m, b, cell):
            continue
        text = git.run(tree, "format-patch", "-1", cell.commit, *git.FORMAT_PATCH_ARGS).stdout
        have = (m.root / cell.file).read_text(encoding="utf-8")
        if text != have:
            new, old = text.splitlines(), have.splitlines()
            pairs = enumerate(zip(new, old, strict=False))
            at = next((i for i, (a, c) in pairs if a != c), min(len(new), len(old)))
            line = old[at] if at < len(old) else "(end of file)"
            drift[cell.patch] = f"would rewrite {cell.file} from line {at + 1}: {line.strip()}"
    return drift


# --- each commit alone -----------------------------------------------------------------------


def closure(m: Manifest, patch_id: str) -> set[str]:
    """`patch_id`'s declared requires, and theirs."""
    seen: set[str] = set()
    stack = list(m.patch(patch_id).requires)
    while stack:
        r = stack.pop()
        if r not in seen:
            seen.add(r)
            stack.extend(m.patch(r).requires)
    return seen


class _Index:
    """A throwaway git index of the tree repository: pristine plus some patches, never the
    tree's own index or work tree."""

    def __init__(self, tree: Path, tmp: Path) -> None:
        self.tree = tree
        self.env = {"GIT_INDEX_FILE": str(tmp / "index")}

    def reset(self) -> None:
        git.run(self.tree, "read-tree", "pristine", env=self.env)

    def apply(self, path: Path, opts: tuple[str, ...], check: bool = False):
        args = ("apply", "--cached", *(("--check",) if check else ()), *opts, patch_arg(path))
        return git.run(self.tree, *args, check=False, env=self.env)

    def stack(self, files: list[tuple[Path, tuple[str, ...]]]) -> str:
        """Reset, then apply `files` in order; '' or the first that does not apply."""
        self.reset()
        for path, opts in files:
            proc = self.apply(path, opts)
            if proc.returncode != 0:
                return f"{path.name}: {conflict_detail(proc.stderr)}"
        return ""

    def write_tree(self) -> str:
        return git.out(self.tree, "write-tree", env=self.env)


@dataclass
class Alone:
    patch: str
    state: str  # ok / FAIL
    detail: str = ""
    tree: str = ""  # the git tree object of pristine + requires + patch (state ok)
    base: str = ""  # ... of pristine + requires


def alone(tree: Path, m: Manifest, cells: list[Cell]) -> list[Alone]:
    """Each applied patch on the pristine tree plus exactly its declared requires."""
    applied = [c for c in cells if c.state == APPLIES]
    order = [c.patch for c in applied]
    opts = {c.patch: NO_TESTS_OPTS if c.excluded else () for c in applied}
    file_of = {c.patch: m.root / c.file for c in applied}
    results: list[Alone] = []
    with tempfile.TemporaryDirectory(prefix="mcore-fixes-alone-") as tmp:
        idx = _Index(tree, Path(tmp))

        def stack(ids: set[str]) -> str:
            return idx.stack([(file_of[i], opts[i]) for i in order if i in ids])

        def with_reqs(q: str) -> set[str]:
            return {q} | {r for r in closure(m, q) if r in file_of}

        def fits(k: int, ids: set[str]) -> bool:  # patch k applies on pristine + `ids`
            path, o = file_of[order[k]], opts[order[k]]
            return not stack(ids) and idx.apply(path, o, check=True).returncode == 0

        def minimal(k: int, reqs: set[str]) -> str:
            """A smallest-by-greedy set of earlier patches (touching its files) it needs."""
            mine = set(git.touched_paths(read_patch(file_of[order[k]])))
            near = [q for q in order[:k] if q not in reqs
                    and mine & set(git.touched_paths(read_patch(file_of[q])))]  # fmt: skip
            chosen = list(near)
            if not fits(k, reqs.union(*map(with_reqs, chosen))):
                return "none of the earlier patches touching its files makes it apply"
            for q in reversed(near):
                rest = [c for c in chosen if c != q]
                if fits(k, reqs.union(*map(with_reqs, rest))):
                    chosen = rest
            return " + ".join(chosen) + " (not in its requires)"

        for k, cell in enumerate(applied):
            reqs = {r for r in closure(m, cell.patch) if r in file_of}
            broken = stack(reqs)
            if broken:
                why = f"its requires do not apply on their own ({broken}): see their rows"
                results.append(Alone(cell.patch, "FAIL", why))
                continue
            base = idx.write_tree()
            proc = idx.apply(file_of[cell.patch], opts[cell.patch])
            if proc.returncode == 0:
                results.append(Alone(cell.patch, "ok", _declared(reqs), idx.write_tree(), base))
                continue
            why = conflict_detail(proc.stderr)
            needs: list[str] = []
            for q in order[:k]:  # (a patch needed only through what q requires is not q)
                if (
                    q not in reqs
                    and not closure(m, q) & set(needs)
                    and fits(k, reqs | with_reqs(q))
                ):
                    needs.append(q)
            if needs:
                hint = f"hidden dependency: needs {' or '.join(needs)} (not in its requires)"
            else:
                hint = "hidden dependency on several earlier patches: " + minimal(k, reqs)
            results.append(Alone(cell.patch, "FAIL", f"{why} on {_declared(reqs)}; {hint}"))
    return results


def _declared(reqs: set[str]) -> str:
    return "the baseline + " + ", ".join(sorted(reqs)) if reqs else "the baseline alone"


_MODULE_DUNDERS = set(
    "__file__ __name__ __doc__ __spec__ __loader__ __package__ __path__ __builtins__ "
    "__annotations__ __dict__ __cached__".split()
)


def undefined_names(source: str, filename: str = "<patch>") -> set[str] | str:
    """Global names `source` uses and never binds (pyflakes' undefined-name, by `symtable`): a
    test reusing a class only an earlier patch adds. A str: the file does not compile. Empty
    where a star import makes the module's names unknowable."""
    try:
        top = symtable.symtable(source, filename, "exec")
    except SyntaxError as exc:
        return f"{filename}:{exc.lineno}: {exc.msg}"
    if re.search(r"^\s*from\s+\S+\s+import\s+\*", source, re.M):
        return set()
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    used: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for sym in table.get_symbols():
            if sym.is_declared_global() and sym.is_assigned():
                bound.add(sym.get_name())
            if sym.is_referenced() and (table is top or sym.is_global()):
                used.add(sym.get_name())
    return used - bound - set(dir(builtins)) - _MODULE_DUNDERS


def names_problems(tree: Path, before: str, after: str, files: list[str]) -> list[str]:
    """Per .py file of `files`: a syntax error, or the names it uses unbound at `after` (a git
    tree object) that were not already unbound at `before` (upstream's own quirks)."""
    problems = []
    for rel in files:
        if not rel.endswith(".py"):
            continue
        new = git.run(tree, "show", f"{after}:{rel}", check=False)
        if new.returncode != 0:
            continue  # removed
        now = undefined_names(new.stdout, rel)
        if isinstance(now, str):
            problems.append(f"does not compile: {now}")
            continue
        old = git.run(tree, "show", f"{before}:{rel}", check=False)
        was = undefined_names(old.stdout, rel) if old.returncode == 0 else set()
        missing = sorted(now - (was if isinstance(was, set) else set()))
        if missing:
            problems.append(f"{rel}: uses {', '.join(missing)}, defined nowhere in the file")
    return problems


def can_collect(python: str) -> str:
    """'' where `python` imports torch and pytest, else why the tests are not collected."""
    proc = subprocess.run(
        [python, "-c", "import torch, pytest"], capture_output=True, text=True, check=False
    )
    if proc.returncode == 0:
        return ""
    return f"{python} cannot import torch and pytest"


def collect(
    tree: Path, tree_object: str, files: list[str], python: str, series_paths: set[str]
) -> tuple[bool | None, str]:
    """pytest --collect-only of `files` on the git tree object `tree_object` (megatron/ and
    tests/unit_tests/ written to a scratch folder): (collected, the first error line); None:
    it needs a module neither the interpreter nor the tree has, and no patch of the series
    (`series_paths`: the paths its patches touch) makes."""
    if not git.ok(tree, "cat-file", "-e", f"{tree_object}:tests/unit_tests"):
        return None, "this tree has no upstream tests/unit_tests/ to collect them in"
    archive = subprocess.run(
        [git.git_exe(), "-C", str(tree), "archive", tree_object, "megatron", "tests/unit_tests"],
        capture_output=True,
        env=git.environment(tree),
        check=True,
    ).stdout
    with tempfile.TemporaryDirectory(prefix="mcore-fixes-collect-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        env = {**os.environ, "PYTHONPATH": tmp, "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [*pytest_command(python, files), "--collect-only"]
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        n = re.search(r"(\d+) tests? collected", proc.stdout)
        return True, f"{n.group(1) if n else '?'} test(s) collected"
    text = proc.stdout + proc.stderr
    errors = re.findall(r"^E\s+(\w*Error.*)$", text, re.M)
    last = errors[0] if errors else (text.strip().splitlines() or ["no output"])[-1]
    missing = re.match(r"ModuleNotFoundError: No module named '([\w.]+)'", last.strip())
    if missing and not _ours(series_paths, missing.group(1)):
        return None, f"needs {missing.group(1)}, which neither {python} nor the tree has"
    return False, last.strip()


def _ours(series_paths: set[str], module: str) -> bool:
    """Whether `module` is a file some patch of the series adds or edits (then its absence is
    a hidden dependency); else it is the environment's (transformer_engine; megatron/training,
    which a tree of megatron/core alone lacks)."""
    rel = module.replace(".", "/")
    return f"{rel}.py" in series_paths or f"{rel}/__init__.py" in series_paths


def patch_tests(m: Manifest, cell: Cell) -> list[str]:
    return [f for f in test_files(read_patch(m.root / cell.file)) if f.endswith(".py")]
