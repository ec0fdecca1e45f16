"""`lint-patches`: each commit of the series, checked the way upstream's CI checks a PR.

Per commit of the series (in the tool's own tree repository, build/trees/<baseline>, one commit
per patch), against its parent:

- ``api``: upstream's ``scripts/check_api_backwards_compatibility.py`` (griffe), read from the
  Megatron-LM checkout at the baseline's commit; a breaking change fails upstream CI;
- ``copyright``: the header check of upstream's CI (NVIDIA-NeMo/FW-CI-templates
  ``_copyright_check.yml``): every added ``*.py`` file but ``__init__.py`` names an NVIDIA
  copyright (or an MIT / Apache license) in its first 10 lines;
- ``pylint``: with the checkout's ``.pylintrc`` on the changed files under ``megatron/core``
  (upstream's pre-commit scope); only messages on lines the commit adds count;
- ``black`` / ``isort``: upstream's settings and scopes (pre-commit: black on megatron/core and
  tests/unit_tests, isort on megatron/core), ``--check`` on every file the commit touches, in
  full (two test functions without black's blank lines between them fail, wherever they are);
  a file the formatter would rewrite is checked again as it was before the commit, and only the
  rewrites the commit introduces count (a pinned black may already reformat upstream's own
  code on older baselines).

Tool versions are the ones upstream pins: black, isort and pylint from the checkout's
``pyproject.toml`` (dependency group ``linting``; main: black 26.3.0, isort 5.13.2, pylint
3.2.6). Upstream pins no griffe (its API-check workflow ran a bare ``pip install griffe``), so
we pin the release we measured with (GRIFFE). With a checkout the tools live in a venv the tool
manages (build/lint-env, made with uv or venv + pip); ``--tools-python`` names an interpreter
that has them instead. Without a checkout the api and pylint checks are skipped (said so), and
black / isort come from PATH.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .. import git
from ..errors import UserError
from ..manifest import Baseline

# Megatron-LM main's settings (pyproject.toml [tool.black], .pre-commit-config.yaml); the
# config file is replaced so that an older baseline's `required-version` does not apply.
BLACK = ["black", "--diff", "-q", "-l", "100", "--skip-string-normalization",
         "--skip-magic-trailing-comma"]  # fmt: skip
ISORT = ["isort", "--diff", "--profile", "black", "-l", "100", "-p", "megatron"]
# Upstream's pre-commit `files:` of each formatter.
BLACK_SCOPE = ("megatron/core/", "tests/unit_tests/")
ISORT_SCOPE = ("megatron/core/",)

# Upstream main's pins (pyproject.toml, dependency group `linting`), used without a checkout.
DEFAULT_PINS = {"black": "26.3.0", "isort": "5.13.2", "pylint": "3.2.6"}
# Upstream pins none: its API-check workflow ran `pip install griffe`. The release we measured
# with (it reproduces upstream's own numbers on the first series).
GRIFFE = "2.4.1"
API_SCRIPT = "scripts/check_api_backwards_compatibility.py"
PYLINTRC = ".pylintrc"
CHECKS = ("api", "copyright", "pylint", "black", "isort")
FORMATTERS = ("black", "isort")

# FW-CI-templates _copyright_check.yml: `head -n 10 | egrep -iv` of these patterns.
_COPYRIGHT_OK = re.compile(
    r"Copyright.*NVIDIA CORPORATION|MIT.*Licen.e|Copyright.*Apache|Apache.*License", re.I
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PYLINT_MSG = re.compile(r"^(?P<path>[^:\n]+):(?P<line>\d+):\d+: (?P<msg>.*)$", re.M)


def added_lines(patch_text: str) -> dict[str, set[str]]:
    """Per file, the lines a patch adds (without the leading '+')."""
    added: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in patch_text.splitlines():
        if line.startswith("+++ "):
            path = line[4:]
            current = added.setdefault(path[2:], set()) if path.startswith("b/") else None
        elif line.startswith("diff --git "):
            current = None
        elif current is not None and line.startswith("+"):
            current.add(line[1:])
    return added


def added_line_numbers(diff_text: str) -> dict[str, set[int]]:
    """Per file, the new-side line numbers a `git diff -U0` adds."""
    numbers: dict[str, set[int]] = {}
    current: set[int] | None = None
    for line in diff_text.splitlines():
        if line.startswith("+++ "):
            path = line[4:]
            current = numbers.setdefault(path[2:], set()) if path.startswith("b/") else None
        elif line.startswith("@@") and current is not None:
            m = re.match(r"@@ -\S+ \+(\d+)(?:,(\d+))? @@", line)
            if m:
                start, count = int(m.group(1)), int(m.group(2) or "1")
                current.update(range(start, start + count))
    return numbers


def new_files(patch_text: str) -> list[str]:
    """Paths a patch creates (`new file mode`)."""
    created: list[str] = []
    path = ""
    for line in patch_text.splitlines():
        if line.startswith("diff --git a/"):
            path = line.partition(" b/")[2]
        elif line.startswith("new file mode") and path:
            created.append(path)
    return created


def _exe(name: str) -> str | None:
    """A tool beside this interpreter (its venv), else on PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def _formatters(tools_bin: Path | None) -> tuple[list[str], list[str]]:
    if tools_bin is None:
        return [_exe("black") or "black", *BLACK[1:]], [_exe("isort") or "isort", *ISORT[1:]]
    return [str(tools_bin / "black"), *BLACK[1:]], [str(tools_bin / "isort"), *ISORT[1:]]


def in_scope(formatter: str, path: str) -> bool:
    """Whether upstream's pre-commit runs `formatter` on `path` (.pre-commit-config.yaml)."""
    if not path.endswith(".py"):
        return False
    return path.startswith(BLACK_SCOPE if formatter == "black" else ISORT_SCOPE)


@dataclass(frozen=True)
class Hunk:
    """One rewrite a formatter would make: a run of -/+ lines, where, and its neighbours."""

    line: int  # in the checked file
    changed: tuple[str, ...]  # the run's -/+ lines
    context: tuple[str, str]  # the nearest unchanged line before and after it

    def describe(self) -> str:
        removed = [ln[1:].strip() for ln in self.changed if ln.startswith("-") and ln[1:].strip()]
        added = [ln[1:].strip() for ln in self.changed if ln.startswith("+")]
        if removed:
            return removed[0]
        if all(not a for a in added):
            return f"missing blank line(s) before `{self.context[1].strip() or 'end of file'}`"
        return f"insert `{next(a for a in added if a)}`"


_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")


def _runs(lines: list[str], start: int) -> list[Hunk]:
    """The change runs of one diff hunk (context lines split them)."""
    runs: list[Hunk] = []
    line, before, run, at = start, "", [], start
    for i, ln in enumerate([*lines, " "]):
        if ln[:1] in "+-":
            if not run:
                at = line
            run.append(ln)
            line += ln[:1] == "-"
            continue
        if run:
            after = ln[1:] if i < len(lines) else ""
            runs.append(Hunk(at, tuple(run), (before, after)))
            run = []
        before = ln[1:]
        line += 1
    return runs


def parse_diff(text: str, paths: list[str]) -> dict[str, list[Hunk]]:
    """A formatter's unified `--diff` output, per checked file (of `paths`): its change runs.

    black names files as given (`--- x.py\t<time>`); isort by absolute path and `:before`.
    """
    out: dict[str, list[Hunk]] = {}
    current: list[Hunk] | None = None
    lines: list[str] = []
    start = 0

    def flush() -> None:
        if current is not None and lines:
            current.extend(_runs(lines, start))

    rows = text.splitlines()
    i = 0
    while i < len(rows):
        row = rows[i]
        if row.startswith("--- ") and i + 1 < len(rows) and rows[i + 1].startswith("+++ "):
            flush()
            lines = []
            name = row[4:].split("\t")[0].removesuffix(":before").strip()
            match = [p for p in paths if name == p or name.endswith("/" + p)]
            current = out.setdefault(max(match, key=len), []) if match else None
            i += 2
            continue
        m = _HUNK.match(row)
        if m:
            flush()
            lines, start = [], int(m.group(1))
        elif current is not None and row[:1] in " +-":
            lines.append(row)
        elif current is not None and row == "":
            lines.append(" ")  # a context line that is empty
        i += 1
    flush()
    return out


def introduced(after: list[Hunk], before: list[Hunk]) -> list[Hunk]:
    """The rewrites of `after` that `before` (the same file before the commit) does not need.

    Matched as multisets: first run for run with its neighbours, then the leftovers by their
    changed lines alone (an upstream problem next to a line the commit changed is upstream's).
    """
    pool = list(before)
    left = _unmatched(after, pool, lambda h: (h.changed, h.context))
    return _unmatched(left, pool, lambda h: h.changed)


def _unmatched(hunks: list[Hunk], pool: list[Hunk], key) -> list[Hunk]:
    """The hunks without a twin (same `key`) in `pool`; each twin found leaves the pool."""
    alone: list[Hunk] = []
    for h in hunks:
        twin = next((b for b in pool if key(b) == key(h)), None)
        if twin is None:
            alone.append(h)
        else:
            pool.remove(twin)
    return alone


class Formatters:
    """black and isort over many file versions, one process per formatter and batch.

    A version is a key (a blob id, or any unique name) and its path and text; it is written to
    <scratch>/<key>/<path> so that every run sees the same layout and settings (the tree's
    isort settings, black's upstream flags), whatever commit the text comes from.
    """

    def __init__(self, tree: Path, scratch: Path, tools_bin: Path | None, names: tuple[str, ...]):
        black, isort = _formatters(tools_bin)
        config = scratch / "black.toml"
        config.write_text("[tool.black]\n")
        self.cmds = {
            "black": [*black, "--config", str(config)],
            "isort": [*isort, "--check-only", f"--settings-path={tree}"],
        }
        self.names, self.scratch = names, scratch
        self.hunks: dict[str, dict[str, list[Hunk]]] = {n: {} for n in names}
        self.failed: dict[str, str] = {}  # formatter -> why it did not run

    def run(self, versions: dict[str, tuple[str, str]]) -> None:
        """Check every version not checked yet (key -> (path, text))."""
        todo: dict[str, list[str]] = {}
        for name in self.names:
            todo[name] = []
            for key, (path, text) in versions.items():
                if key in self.hunks[name] or not in_scope(name, path):
                    continue
                target = self.scratch / key / path
                if not target.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(text, encoding="utf-8")
                todo[name].append(f"{key}/{path}")
        jobs = [n for n in self.names if todo[n] and n not in self.failed]
        with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
            procs = list(pool.map(lambda n: subprocess.run([*self.cmds[n], *todo[n]],
                     cwd=self.scratch, capture_output=True, text=True), jobs))  # fmt: skip
        for name, proc in zip(jobs, procs, strict=True):
            if proc.returncode not in (0, 1):
                self.failed[name] = f"{name} failed: {proc.stderr.strip()[-300:]}"
                continue
            found = parse_diff(proc.stdout, todo[name])
            for rel in todo[name]:
                self.hunks[name][rel.partition("/")[0]] = found.get(rel, [])

    def problems(self, name: str, path: str, after: str, before: str | None) -> list[str] | None:
        """What `name` would rewrite in version `after` of `path` that version `before` (None:
        the commit adds the file) does not need; None: `before` must be checked first."""
        if name in self.failed:
            return [self.failed[name]]
        mine = self.hunks[name].get(after, [])
        if mine and before is not None and before not in self.hunks[name]:
            return None
        old = self.hunks[name].get(before, []) if before is not None else []
        return [f"{path}:{h.line}: {name} would rewrite: {h.describe()}"
                for h in introduced(mine, old)]  # fmt: skip


def formatter_problems(
    tree: Path,
    files: list[str],
    before: dict[str, str | None],
    tools_bin: Path | None = None,
    names: tuple[str, ...] = FORMATTERS,
) -> dict[str, list[str]]:
    """Per formatter of `names`, what it would rewrite in the touched `files` of `tree`, in full,
    that it would not rewrite in the same file before the commit (`before`: path -> its text
    there, None where the commit adds the file). Empty lists: clean.
    """
    commits = [("after", {f: (tree / f).read_text(encoding="utf-8") for f in files
                          if (tree / f).is_file()}, before)]  # fmt: skip
    return batch_problems(tree, commits, tools_bin, names)[0]


def batch_problems(
    tree: Path,
    commits: list[tuple[str, dict[str, str], dict[str, str | None]]],
    tools_bin: Path | None = None,
    names: tuple[str, ...] = FORMATTERS,
) -> list[dict[str, list[str]]]:
    """`formatter_problems` of many commits at once: per commit (a name, path -> text after,
    path -> text before or None), per formatter, its problems.

    Versions are keyed by content, so a file's text before commit k that is its text after
    commit k-1 is checked once; each formatter runs twice at most (the versions after the
    commits, then the versions before of the files it would rewrite), so a series of many
    commits costs two black and two isort processes, not four per commit.
    """

    def key(text: str) -> str:
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    with tempfile.TemporaryDirectory(prefix="mcore-fixes-fmt-") as tmp:
        fmt = Formatters(tree, Path(tmp), tools_bin, names)
        fmt.run({key(t): (p, t) for _, after, _ in commits for p, t in after.items()})
        need: dict[str, tuple[str, str]] = {}
        for _, after, before in commits:
            for p, t in after.items():
                old = before.get(p)
                for name in names:
                    if old is not None and fmt.problems(name, p, key(t), key(old)) is None:
                        need[key(old)] = (p, old)
        fmt.run(need)
        out = []
        for _, after, before in commits:
            per: dict[str, list[str]] = {name: [] for name in names}
            for p, t in sorted(after.items()):
                old = before.get(p)
                for name in names:
                    per[name] += (
                        fmt.problems(name, p, key(t), None if old is None else key(old)) or []
                    )
            out.append(per)
        return out


def copyright_problems(tree: Path, patch_text: str) -> list[str]:
    """Added Python files (not __init__.py) without an NVIDIA copyright in their first 10 lines."""
    problems = []
    for path in new_files(patch_text):
        if not path.endswith(".py") or path.endswith("__init__.py") or not (tree / path).exists():
            continue  # (a file left out where the tree has no tests/: not added there)
        head = (tree / path).read_text(encoding="utf-8", errors="replace").splitlines()[:10]
        if not _COPYRIGHT_OK.search("\t".join(head)):
            problems.append(f"{path}: no NVIDIA copyright line in its first 10 lines")
    return problems


# --- pins and the tool environment -----------------------------------------------------------


@dataclass(frozen=True)
class Upstream:
    """Upstream's CI inputs for one baseline commit, read from the user's checkout."""

    commit: str
    pins: dict[str, str]  # tool -> version
    script: Path | None  # the API checker, written to a scratch dir (never into this repo)
    pylintrc: Path | None

    def pin_of(self, tool: str) -> str:
        return self.pins.get(tool, DEFAULT_PINS.get(tool, ""))


def _show(repo: Path, commit: str, rel: str) -> str | None:
    proc = git.run(repo, "show", f"{commit}:{rel}", check=False)
    return proc.stdout if proc.returncode == 0 else None


def read_pins(pyproject_text: str | None, precommit_text: str | None = None) -> dict[str, str]:
    """black/isort/pylint versions pinned by upstream (`name==X` in pyproject, else pre-commit)."""
    pins: dict[str, str] = {}
    if pyproject_text:
        try:
            data = tomllib.loads(pyproject_text)
        except tomllib.TOMLDecodeError:
            data = {}
        groups = [*data.get("dependency-groups", {}).values()]
        groups += [*data.get("project", {}).get("optional-dependencies", {}).values()]
        for group in groups:
            for req in group if isinstance(group, list) else []:
                m = re.fullmatch(r"\s*(black|isort|pylint)\s*==\s*([\w.]+)\s*", str(req))
                if m:
                    pins.setdefault(m.group(1), m.group(2))
    if precommit_text:
        for tool, rev in re.findall(
            r"repo: \S*/(black|isort|pylint)\s*\n\s*rev: '?(?:refs/tags/)?v?([\w.]+)",
            precommit_text,
        ):
            pins.setdefault(tool, rev)
    return pins


def upstream_inputs(mcore_repo: Path, commit: str, scratch: Path) -> Upstream:
    pins = read_pins(
        _show(mcore_repo, commit, "pyproject.toml"),
        _show(mcore_repo, commit, ".pre-commit-config.yaml"),
    )
    paths: dict[str, Path | None] = {}
    for rel in (API_SCRIPT, PYLINTRC):
        text = _show(mcore_repo, commit, rel)
        if text is None:
            paths[rel] = None
            continue
        target = scratch / commit[:12] / Path(rel).name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        paths[rel] = target
    return Upstream(commit, pins, paths[API_SCRIPT], paths[PYLINTRC])


def _versions(python: str) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json\n"
        "out = {}\n"
        "for n in ('black', 'isort', 'pylint', 'griffe'):\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"--tools-python {python}: cannot run it: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout)


def tool_env(root: Path, pins: dict[str, str]) -> Path:
    """The interpreter of build/lint-env/<hash>, a venv with exactly the pinned tools."""
    wanted = {**DEFAULT_PINS, **pins, "griffe": GRIFFE}
    reqs = sorted(f"{k}=={v}" for k, v in wanted.items())
    key = hashlib.sha256("\n".join(reqs).encode()).hexdigest()[:12]
    env = root / "build" / "lint-env" / key
    python = env / "bin" / "python"
    stamp = env / "mcore-fixes-requirements.txt"
    if stamp.exists() and stamp.read_text() == "\n".join(reqs) + "\n" and python.exists():
        return python
    if env.exists():
        shutil.rmtree(env)
    env.parent.mkdir(parents=True, exist_ok=True)
    uv = shutil.which("uv")
    if uv:
        steps = [
            [uv, "venv", "-q", "--python", sys.executable, str(env)],
            [uv, "pip", "install", "-q", "--python", str(python), *reqs],
        ]
    else:
        steps = [
            [sys.executable, "-m", "venv", str(env)],
            [str(python), "-m", "pip", "install", "-q", *reqs],
        ]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(env, ignore_errors=True)
            tail = " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise UserError(
                f"could not install upstream's lint tools ({' '.join(reqs)}) into {env}: {tail}. "
                "Offline, pass --tools-python PY naming an interpreter that has them."
            )
    stamp.write_text("\n".join(reqs) + "\n")
    return python


# --- per commit ------------------------------------------------------------------------------


@dataclass
class Result:
    check: str
    state: str  # ok / FAIL / skipped
    detail: str = ""
    problems: tuple[str, ...] = ()


def drop_stale_griffe_worktrees(tree: Path) -> None:
    """Upstream's API checker (griffe) checks the baseline out in a worktree on a branch
    `griffe-<sha>` of `tree` and removes both when it is done; a run killed in between leaves
    them, and the next check of that commit fails ("a branch named ... already exists"). `tree`
    is the tool's own: drop them."""
    for block in git.out(tree, "worktree", "list", "--porcelain").split("\n\n"):
        fields = dict(line.split(" ", 1) for line in block.splitlines() if " " in line)
        if fields.get("branch", "").startswith("refs/heads/griffe-"):
            git.run(tree, "worktree", "remove", "--force", fields["worktree"], check=False)
    git.run(tree, "worktree", "prune")
    stale = git.out(tree, "for-each-ref", "--format=%(refname:short)", "refs/heads/griffe-*")
    for branch in stale.split():
        git.run(tree, "branch", "-D", branch)


def _api(tree: Path, parent: str, commit: str, up: Upstream, python: str) -> Result:
    if up.script is None:
        return Result("api", "skipped", f"the checkout has no {API_SCRIPT} at {up.commit[:10]}")
    drop_stale_griffe_worktrees(tree)
    cmd = [python, str(up.script), "--baseline", parent, "--current", commit]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    text = _ANSI.sub("", proc.stdout + proc.stderr)
    if proc.returncode == 0:
        return Result("api", "ok", "0 breaking changes")
    if proc.returncode == 1:
        found = re.findall(r"^\s*→ (.*)$", text, re.M)
        return Result("api", "FAIL", f"{len(found)} breaking change(s)", tuple(found))
    last = (text.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return Result("api", "FAIL", f"the checker did not run: {last}")


def _pylint(
    tree: Path, parent: str, commit: str, files: list[str], up: Upstream, tools_bin: Path
) -> Result:
    if up.pylintrc is None:
        return Result("pylint", "skipped", f"the checkout has no {PYLINTRC} at {up.commit[:10]}")
    targets = [f for f in files if f.startswith("megatron/core/") and f.endswith(".py")]
    if not targets:
        return Result("pylint", "ok", "no changed file under megatron/core")
    template = "--msg-template={path}:{line}:{column}: {msg_id} {msg} ({symbol})"
    cmd = [str(tools_bin / "pylint"), f"--rcfile={up.pylintrc}", "-sn", template, *targets]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if proc.returncode & 1 or proc.returncode >= 32:  # fatal or usage error
        return Result("pylint", "FAIL", f"pylint did not run: {proc.stderr.strip()[-300:]}")
    diff = git.out(tree, "diff", "-U0", parent, commit, "--", *targets)
    ours = added_line_numbers(diff)
    mine, theirs = [], 0
    for m in _PYLINT_MSG.finditer(proc.stdout):
        if int(m.group("line")) in ours.get(m.group("path"), set()):
            mine.append(f"{m.group('path')}:{m.group('line')}: {m.group('msg')}")
        else:
            theirs += 1
    note = f"; {theirs} on upstream's own lines (not counted)" if theirs else ""
    if mine:
        return Result("pylint", "FAIL", f"{len(mine)} message(s) on added lines{note}", tuple(mine))
    return Result("pylint", "ok", f"{len(targets)} file(s){note}")


def check_commit(
    tree: Path,
    parent: str,
    commit: str,
    patch_text: str,
    up: Upstream | None,
    python: str | None,
    why_skipped: str,
    formatted: dict[str, list[str]] | None = None,
) -> list[Result]:
    """Every check of CHECKS for one commit of the tree repository (checked out here).

    `formatted`: the formatters' problems of this commit, where `batch_problems` had them for
    the whole series; else they run here.
    """
    git.run(tree, "checkout", "-q", "-f", commit)
    files = git.out(tree, "diff", "--name-only", "--diff-filter=d", parent, commit).splitlines()
    tools_bin = Path(python).parent if python else None
    results: list[Result] = []
    if up is None or python is None:
        results.append(Result("api", "skipped", why_skipped))
    else:
        results.append(_api(tree, parent, commit, up, python))
    bad = copyright_problems(tree, patch_text)
    n_new = len([p for p in new_files(patch_text) if p.endswith(".py")])
    results.append(
        Result("copyright", "FAIL", f"{len(bad)} file(s)", tuple(bad))
        if bad
        else Result("copyright", "ok", f"{n_new} added Python file(s)")
    )
    if up is None or python is None or tools_bin is None:
        results.append(Result("pylint", "skipped", why_skipped))
    else:
        results.append(_pylint(tree, parent, commit, files, up, tools_bin))
    exes = {name: (tools_bin / name) if tools_bin else _exe(name) for name in FORMATTERS}
    have = [name for name, exe in exes.items() if exe is not None and Path(exe).exists()]
    found: dict[str, list[str]] = {}
    if formatted is not None:
        found = formatted
    elif have:  # both formatters in one go (they run side by side), each over every touched file
        found = batch_problems(tree, [_versions_of(tree, parent, commit, files)], tools_bin,
                               tuple(have))[0]  # fmt: skip
    for name in FORMATTERS:
        if name not in have:
            results.append(Result(name, "skipped", f"{name} is not on PATH"))
            continue
        problems = found[name]
        n_files = len([f for f in files if in_scope(name, f)])
        results.append(
            Result(name, "FAIL", f"{len(problems)} rewrite(s)", tuple(problems))
            if problems
            else Result(name, "ok", f"{n_files} file(s) in full")
        )
    return results


def _versions_of(
    tree: Path, parent: str, commit: str, files: list[str]
) -> tuple[str, dict[str, str], dict[str, str | None]]:
    """A commit's touched Python files in any formatter's scope: (commit, after, before)."""
    mine = [f for f in files if any(in_scope(n, f) for n in FORMATTERS)]
    after = {f: t for f in mine if (t := _show(tree, commit, f)) is not None}
    return commit, after, {f: _show(tree, parent, f) for f in after}


def tree_formatter_pins(tree: Path) -> dict[str, str]:
    """The black/isort versions a baseline's own pyproject.toml pins, where it has one."""
    path = tree / "pyproject.toml"
    pins = read_pins(path.read_text(encoding="utf-8") if path.exists() else None)
    return {k: v for k, v in pins.items() if k in FORMATTERS}


def formatter_python(root: Path, pins: dict[str, str], tools_python: str | None) -> str | None:
    """An interpreter with the pinned formatters; None: those on PATH (the default pins)."""
    if tools_python or all(v == DEFAULT_PINS[k] for k, v in pins.items()):
        return tools_python
    return str(tool_env(root, pins))


def versions_line(
    python: str | None, up: Upstream | None, own: dict[str, str] | None = None
) -> str:
    """Which tool versions ran, and which upstream pins, for the report."""
    if python is None:
        found = {}
        for name in FORMATTERS:
            exe = _exe(name)
            if exe:
                proc = subprocess.run([exe, "--version"], capture_output=True, text=True)
                m = re.search(r"(\d+\.\d+(?:\.\d+)?)", proc.stdout + proc.stderr)
                found[name] = m.group(1) if m else "?"
    else:
        found = _versions(python)
    pins = {**DEFAULT_PINS, **(up.pins if up else own or {}), "griffe": GRIFFE}
    parts = []
    for name in ("griffe", "pylint", "black", "isort"):
        have = found.get(name, "-")
        mark = "" if have == pins[name] else f" (upstream pins {pins[name]})"
        parts.append(f"{name} {have}{mark}")
    return ", ".join(parts)


def check_versions(python: str, up: Upstream) -> None:
    """UserError when --tools-python has other versions than upstream pins."""
    found = _versions(python)
    wanted = {**DEFAULT_PINS, **up.pins}
    wrong = [f"{k}=={v} (found {found.get(k, 'none')})" for k, v in wanted.items()
             if found.get(k) != v]  # fmt: skip
    if "griffe" not in found:
        wrong.append("griffe (not installed)")
    if wrong:
        raise UserError(f"{python} lacks upstream's pinned lint tools: {', '.join(wrong)}")


# --- the verb --------------------------------------------------------------------------------


def lint_patches(
    root: Path,
    manifest,
    baselines: list,
    tree_or_skip,
    mcore_repo: Path | None,
    tools_python: str | None,
    say=print,
    python_tests: str | None = None,
) -> int:
    """`lint-patches`: one line per commit and check; returns the exit status (1: a check failed).

    `tree_or_skip(b)` gives the pristine tree repository of baseline `b`, or why it is skipped.
    Besides upstream's checks per commit: the series as stacked (mcore_fixes/maint/stack.py:
    `index`, `export`) and each commit alone (`alone`, `collect` with `python_tests`, an interpreter
    with torch and pytest; None: the one running the tool, where it has them).
    """
    from ..series import APPLIES, CONFLICT, MISSING, apply_series, read_patch  # noqa: PLC0415
    from . import stack  # noqa: PLC0415

    for b in baselines if mcore_repo is not None else []:  # its checks read that commit
        if b.is_git and not git.ok(mcore_repo, "cat-file", "-e", f"{b.commit}^{{commit}}"):
            raise UserError(
                f"commit {b.commit} ({b.name}) is not in {mcore_repo}, so upstream's checks "
                f"cannot run on {b.name}: run `git fetch --tags origin` there (or leave "
                "--mcore-repo out: the api and pylint checks are then skipped, and said so)"
            )
    failed = 0
    python: str | None = None
    tests_python = python_tests or sys.executable
    no_collect = stack.can_collect(tests_python)
    with tempfile.TemporaryDirectory(prefix="mcore-fixes-lint-") as scratch:
        for b in baselines:
            tree = tree_or_skip(b)
            if isinstance(tree, str):
                # without its tree, what the patch files alone tell: the blob chain
                series = stack.effective_series(manifest, b, None)
                texts = [(pid, read_patch(path)) for pid, path in series]
                owned = stack.owned_ids(manifest, b)
                chain = stack.blob_chain(texts, None, with_tests=b.is_git, owned=owned)
                bad = {pid: found for pid, found in chain.items() if found}
                for pid, found in bad.items():
                    say(f"{b.name}  {pid:<26} {'index':<9} FAIL  {found[0]}")
                    for problem in found[1:]:
                        say(f"    {problem}")
                failed += len(bad)
                say(
                    f"{b.name}: skipped: {tree}; index chain of its {len(series)} patch file(s): "
                    f"{len(bad)} failed"
                )
                continue
            up: Upstream | None = None
            if mcore_repo is None:
                why = "no Megatron-LM checkout (pass --mcore-repo PATH or set MCORE_REPO)"
            elif not b.is_git:
                why = "a PyPI baseline: upstream's CI inputs come from git baselines"
            else:
                why = ""
                up = upstream_inputs(mcore_repo, b.commit, Path(scratch))
                # each baseline's own pins (a tag pins older black than main): one env per pin set
                python = tools_python or str(tool_env(root, up.pins))
                check_versions(python, up)
            cells = apply_series(tree, manifest, b)
            # without upstream's inputs: the black/isort its own pyproject.toml pins (an sdist
            # ships it; 0.14 .. 0.18 pin an older black than main)
            own = {} if up else tree_formatter_pins(tree)
            fmt_python = python if up else formatter_python(root, own, tools_python)
            say(f"{b.name}: tools: {versions_line(fmt_python, up, own)}")
            if why:
                say(f"{b.name}: skipped api, pylint: {why}")
            no_tests = _no_upstream_tests(tree, b)
            if no_tests:
                say(f"{b.name}: skipped collect: {no_tests}")
            quiet = {*(("api", "pylint") if why else ()), *(("collect",) if no_tests else ())}
            extra = _stack_results(tree, manifest, b, cells, tests_python, no_tests or no_collect)
            formatted = _format_series(tree, cells, fmt_python)
            n_fail = n_skip = n_checks = n_commits = 0
            for cell in cells:
                if cell.state != APPLIES:
                    # with a checkout the question is "ready for upstream?": it must apply;
                    # without one (formatters only) `status` is the place for applicability
                    bad = cell.state in (CONFLICT, MISSING) and mcore_repo is not None
                    n_fail += bad
                    state = "FAIL" if bad else "-"
                    what = f"{cell.state}: {cell.detail}"
                    say(f"{b.name}  {cell.patch:<26} {'apply':<9} {state}  {what}")
                    continue
                n_commits += 1
                text = read_patch(manifest.root / cell.file)
                parent = git.out(tree, "rev-parse", f"{cell.commit}^")
                results = check_commit(tree, parent, cell.commit, text, up, fmt_python, why,
                                       formatted.get(cell.patch))  # fmt: skip
                for r in [*results, *extra.get(cell.patch, [])]:
                    n_checks += 1
                    if r.state == "skipped" and r.check in quiet:
                        n_skip += 1
                        continue  # said once per baseline above
                    n_fail += r.state == "FAIL"
                    n_skip += r.state == "skipped"
                    detail = f"  {r.detail}" if r.detail else ""
                    say(f"{b.name}  {cell.patch:<26} {r.check:<9} {r.state}{detail}")
                    for problem in r.problems:
                        say(f"    {problem}")
            git.run(tree, "checkout", "-q", "-f", cells and _last(cells) or "pristine")
            failed += n_fail
            say(
                f"{b.name}: {n_commits} commit(s), {n_checks} checks: "
                f"{n_fail} failed, {n_skip} skipped"
            )
    return 1 if failed else 0


def _no_upstream_tests(tree: Path, b: Baseline) -> str:
    """Why `collect` cannot run on `b` ('' where its pristine tree has upstream's tests/)."""
    if git.ok(tree, "cat-file", "-e", "pristine:tests/unit_tests"):
        return ""
    where = f"the same code, --baseline {b.same_code_as}" if b.same_code_as else "a git baseline"
    return f"a PyPI sdist has no upstream tests/ (collect them on {where})"


def _format_series(tree: Path, cells: list, python: str | None) -> dict[str, dict[str, list[str]]]:
    """black/isort problems of every applied commit, in one batch (see `batch_problems`)."""
    tools_bin = Path(python).parent if python else None
    exes = {name: (tools_bin / name) if tools_bin else _exe(name) for name in FORMATTERS}
    have = tuple(n for n, exe in exes.items() if exe is not None and Path(exe).exists())
    applied = [c for c in cells if c.commit]
    if not have or not applied:
        return {}
    commits = []
    for c in applied:
        parent = git.out(tree, "rev-parse", f"{c.commit}^")
        files = git.out(tree, "diff", "--name-only", "--diff-filter=d", parent, c.commit)
        commits.append(_versions_of(tree, parent, c.commit, files.splitlines()))
    found = batch_problems(tree, commits, tools_bin, have)
    return {c.patch: per for c, per in zip(applied, found, strict=True)}


def _stack_results(
    tree: Path, manifest, b, cells: list, tests_python: str, no_collect: str
) -> dict[str, list[Result]]:
    """Per applied patch: `index`, `export`, `alone` and `collect` (mcore_fixes/maint/stack.py)."""
    from ..series import read_patch  # noqa: PLC0415
    from . import stack  # noqa: PLC0415

    out: dict[str, list[Result]] = {}
    series = stack.effective_series(manifest, b, cells)
    texts = [(pid, read_patch(path)) for pid, path in series]
    owned = stack.owned_ids(manifest, b)
    blobs = stack.stack_blobs(tree, cells)
    chain = stack.blob_chain(texts, None, b.is_git, owned, blobs)
    drift = stack.export_drift(tree, manifest, b, cells)
    by_id = {c.patch: c for c in cells}
    ours = {f for _, text in texts for f in git.touched_paths(text)}
    for pid, _ in series:
        found = chain.get(pid, [])
        cell = by_id[pid]
        rows = [
            Result("index", "FAIL", f"{len(found)} file(s)", tuple(found))
            if found
            else Result("index", "ok", "pre-images are what the stack before it leaves")
            if pid in owned
            else Result("index", "skipped", f"not {b.name}'s file (targets {manifest.canonical})")
        ]
        if pid in drift:
            rows.append(Result("export", "FAIL", drift[pid]))
        elif cell.excluded or not stack.owned(manifest, b, cell):
            why = "its tests are not in this tree" if cell.excluded else f"not {b.name}'s file"
            rows.append(Result("export", "skipped", why))
        else:
            rows.append(Result("export", "ok", "no edits: byte-identical"))
        out[pid] = rows
    collects: list[tuple[str, list[str], str]] = []  # patch, test files, its tree object
    for a in stack.alone(tree, manifest, cells):
        out[a.patch].append(Result("alone", a.state, a.detail))
        if a.state != "ok":
            continue
        touched = git.touched_paths(read_patch(manifest.root / by_id[a.patch].file))
        unbound = stack.names_problems(tree, a.base, a.tree, touched)
        n_py = len([f for f in touched if f.endswith(".py")])
        out[a.patch].append(
            Result("names", "FAIL", f"{len(unbound)} file(s)", tuple(unbound))
            if unbound
            else Result("names", "ok", f"{n_py} file(s) compile, no unbound global name")
        )
        tests = stack.patch_tests(manifest, by_id[a.patch])
        if not tests:
            continue
        if no_collect:
            out[a.patch].append(Result("collect", "skipped", no_collect))
            continue
        collects.append((a.patch, tests, a.tree))
    # one interpreter per patch (torch + megatron imports): side by side, one per core
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = pool.map(lambda c: stack.collect(tree, c[2], c[1], tests_python, ours), collects)
        for (patch, _, _), (ok, detail) in zip(collects, done, strict=True):
            state = "skipped" if ok is None else "ok" if ok else "FAIL"
            out[patch].append(Result("collect", state, detail))
    return out


def _last(cells) -> str:
    commits = [c.commit for c in cells if c.commit]
    return commits[-1] if commits else "pristine"
