"""`suites`: upstream's neighbouring suites, pristine vs patched, and the carried tests proven.

On a full Megatron-LM checkout (a work tree, or a tarball of one: megatron/, tests/unit_tests/,
examples/, the builders upstream's tests import) and a machine with GPUs, in a scratch tree
repository the tool owns (build/suites/<baseline>; the user's checkout is only read):

1. the series is applied (one commit per patch), and three work trees are made: ``pristine``
   (the checkout as it is), ``tests-only`` (pristine code with the series' test changes) and
   ``patched`` (the whole series);
2. on each, one local edit: a module-level ``transformer_engine`` import of a suite file is
   guarded (machines without Transformer Engine), the same on every tree;
3. the suites (the homes of the carried tests: SUITES, plus every test file the series touches)
   run on ``pristine`` and ``patched``, and the carried tests (the test functions the series
   adds or changes) on ``tests-only``, each as upstream's CI runs them:
   ``torchrun --nproc_per_node=N -m pytest`` with a junit XML report per rank;
4. the report lists every test whose outcome differs between pristine and patched, and per
   carried test its outcome on tests-only (must fail) and patched (must pass).

The three runs go in parallel (separate ports; N=1 each on a single-GPU machine).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from .. import git
from ..errors import UserError
from ..manifest import Baseline, Manifest
from ..series import ABSENT, APPLIES, FIXED, OK_STATES, apply_series, read_patch

SUITES = (  # the carried tests' homes, then the suites that import the modules the series edits
    "tests/unit_tests/test_optimizer.py",
    "tests/unit_tests/dist_checkpointing/test_optimizer.py",
    "tests/unit_tests/models/mimo/test_mimo_optimizer_consensus.py",
    "tests/unit_tests/optimizer",
    "tests/unit_tests/distributed/mfsdp_v1",
    "tests/unit_tests/test_layer_wise_optimizer.py",
    "tests/unit_tests/dist_checkpointing/test_layer_wise_optimizer.py",
    "tests/unit_tests/test_emerging_optimizers.py",
    "tests/unit_tests/distributed/test_distributed_data_parallel.py",
    "tests/unit_tests/distributed/test_layer_wise_param_layout.py",
    "tests/unit_tests/models/mimo/test_mimo_checkpoint.py",
    "tests/unit_tests/models/mimo/test_mimo_overlap_lifecycle.py",
    "tests/unit_tests/training/test_param_norm.py",
)
STATES = ("pristine", "tests-only", "patched")
_TE_IMPORT = re.compile(
    r"^(from transformer_engine[\w.]* import [^()\n]+"
    r"|import transformer_engine[\w.]*(?: as \w+)?)$",
    re.M,
)
_TEST_DEF = re.compile(r"^\+([ \t]*)(?:async )?def (test_\w+)\(", re.M)  # within one line

# Per-rank junit file: pytest's --junitxml would have every rank write the same path.
RANK_PLUGIN = """import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    rank = os.environ.get("RANK", "0")
    path = getattr(config.option, "xmlpath", None)
    if path:
        config.option.xmlpath = path.replace(".xml", f".rank{rank}.xml")
    # one base per run and rank: upstream's tmp_path_dist_ckpt is basetemp/../.. + tmp_dist_ckpt,
    # shared by the ranks of a run, never by two runs at once
    base = os.environ.get("MCORE_FIXES_BASETEMP")
    if base:
        config.option.basetemp = os.path.join(base, "run", f"rank{rank}")
"""

TE_GUARD = (
    "try:  # mcore-fixes suites: local edit on every tree (no Transformer Engine here)\n"
    "    {line}\n"
    "except ImportError:\n"
    "    pass\n"
)


def materialize(source: Path, dest: Path) -> str:
    """Copy a full checkout (work tree or .tar[.gz]) into `dest` (a fresh directory); return
    what was copied, in words. A git work tree is copied as it is: its tracked files with
    their uncommitted changes, and its untracked files that git does not ignore."""
    dest.mkdir(parents=True)
    if source.is_file():  # the checkout's content: `tar -C CHECKOUT -czf X.tar.gz .`
        try:
            with tarfile.open(source) as tar:
                tar.extractall(dest, filter="data")
        except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
            why = str(exc).splitlines()[0].rstrip(":")  # tarfile lists each method tried
            raise UserError(f"{source} is not a readable tarball of a checkout ({why})") from None
        if not (dest / "megatron").is_dir():
            raise UserError(f"{source}: no megatron/ at the top of the archive")
        return f"the tarball {source}"
    if not source.is_dir():
        raise UserError(f"{source}: neither a checkout directory nor a tarball")
    if not git.ok(source, "rev-parse", "--is-inside-work-tree"):
        shutil.copytree(source, dest, dirs_exist_ok=True, symlinks=True)
        return f"the folder {source}"
    listing = git.run(source, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for rel in sorted({p for p in listing.stdout.split("\0") if p}):
        src = source / rel
        if src.is_symlink() or src.is_file():  # not a submodule's folder (nor git archive)
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel, follow_symlinks=False)
    fields = iter(
        git.run(source, "status", "--porcelain", "-z", "--untracked-files=all").stdout.split("\0")
    )
    changed = untracked = 0
    for entry in fields:
        if entry.startswith("??"):
            untracked += 1
        elif entry:
            changed += 1
            if {"R", "C"} & set(entry[:2]):
                next(fields, None)  # the rename's source
    head = git.run(source, "rev-parse", "-q", "--verify", "--short=10", "HEAD", check=False)
    return (
        f"the work tree {source} as it is: HEAD {head.stdout.strip() or '(no commit yet)'}, "
        f"{changed} uncommitted change(s), "
        f"{untracked} untracked file(s) (ignored files left out)"
    )


def guard_te_imports(tree: Path, files: list[str]) -> list[str]:
    """Guard module-level transformer_engine imports of `files`; return the edited paths."""
    edited = []
    for rel in files:
        path = tree / rel
        paths = sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
        for p in paths:
            if not p.exists():
                continue
            text = p.read_text()
            new = _TE_IMPORT.sub(lambda m: TE_GUARD.format(line=m.group(1)).rstrip("\n"), text)
            if new != text:
                p.write_text(new)
                edited.append(p.relative_to(tree).as_posix())
    return edited


def carried_tests(patch_texts: list[str]) -> dict[str, set[str]]:
    """Per test file, the test functions the patches add or change (names, no parameters)."""
    tests: dict[str, set[str]] = {}
    for text in patch_texts:
        for section in re.split(r"^diff --git ", text, flags=re.M)[1:]:
            path = section.split("\n", 1)[0].partition(" b/")[2]
            if not path.startswith("tests/") or not path.endswith(".py"):
                continue
            names = {m.group(2) for m in _TEST_DEF.finditer(section)}
            names |= _changed_bodies(section)
            if names:
                tests.setdefault(path, set()).update(names)
    return tests


def _changed_bodies(section: str) -> set[str]:
    """Existing tests whose body a hunk changes: the @@ header names the enclosing function.

    Only when the hunk removes a line, or adds an indented line before any new def/class
    (lines added after the end of a function are new code, not a change of it).
    """
    names = set()
    for hunk in re.split(r"^(?=@@ )", section, flags=re.M)[1:]:
        m = re.match(r"@@ [^@]* @@.*\bdef (test_\w+)\(", hunk)
        if not m:
            continue
        for line in hunk.splitlines()[1:]:
            if line.startswith("-"):
                names.add(m.group(1))
                break
            if line.startswith("+"):
                body = line[1:]
                if re.match(r"\s*(async )?(def|class) ", body) or (body and not body[0].isspace()):
                    break
                if body.strip():
                    names.add(m.group(1))
                    break
    return names


@dataclass
class Outcomes:
    """Test id (classname::name) -> passed / failed / error / skipped, merged over ranks."""

    by_id: dict[str, str] = field(default_factory=dict)
    files: int = 0


_RANK_ORDER = {"error": 3, "failed": 2, "passed": 1, "skipped": 0}


def read_junit(paths: list[Path]) -> Outcomes:
    """Merge per-rank junit files: a test failed if it failed on any rank."""
    result = Outcomes()
    for path in paths:
        if not path.exists():
            continue
        result.files += 1
        for case in ET.parse(path).iter("testcase"):
            key = f"{case.get('classname', '')}::{case.get('name', '')}"
            state = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    state = {"failure": "failed"}.get(child.tag, child.tag)
                    break
            old = result.by_id.get(key)
            if old is None or _RANK_ORDER[state] > _RANK_ORDER[old]:
                result.by_id[key] = state
    return result


def _module(path: str) -> str:
    return path[:-3].replace("/", ".")


def _matches(test_id: str, path: str, name: str) -> bool:
    classname, _, case = test_id.partition("::")
    mod = _module(path)
    return (classname == mod or classname.startswith(mod + ".")) and case.split("[")[0] == name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(python: str) -> list[str]:
    exe = Path(python).parent / "torchrun"
    return [str(exe)] if exe.exists() else [python, "-m", "torch.distributed.run"]


def _prepare(work: Path, source: Path, m: Manifest, b: Baseline, say) -> tuple[str, list, dict]:
    if work.exists():
        for wt in STATES:
            if (work / wt).exists():
                shutil.rmtree(work / wt)
        shutil.rmtree(work)
    repo = work / "repo"
    say(f"copying {source} into {repo}")
    tested = materialize(source, repo)
    say(f"pristine is {tested}")
    git.run(repo, "init", "-q", env=git.NEUTRAL_CONFIG)
    (repo / ".git" / git.TOOL_TREE_MARKER).write_text(f"suites {b.name}\n")
    git.run(repo, "add", "-A", "-f")
    git.run(repo, "commit", "-q", "--no-verify", "-m", f"pristine {b.name}", env=git.TOOL_IDENTITY)
    git.run(repo, "tag", "pristine")
    cells = apply_series(repo, m, b)
    bad = [c for c in cells if c.state not in (*OK_STATES, ABSENT)]
    if bad:
        raise UserError(
            f"the series does not apply to this checkout: {bad[0].patch}: {bad[0].detail}"
        )
    for c in cells:
        if c.state == FIXED:  # upstream's own fix is in pristine: nothing of ours to carry
            say(f"{c.patch}: fixed upstream ({c.detail}), skipped")
    texts = [read_patch(m.root / c.file) for c in cells if c.state == APPLIES]
    head = git.out(repo, "rev-parse", "HEAD")
    git.run(repo, "worktree", "add", "-q", "--detach", str(work / "pristine"), "pristine")
    git.run(repo, "worktree", "add", "-q", "--detach", str(work / "patched"), head)
    git.run(repo, "worktree", "add", "-q", "--detach", str(work / "tests-only"), "pristine")
    diff = git.run(repo, "diff", "--binary", "pristine", head, "--", "tests").stdout
    if diff:
        git.run(work / "tests-only", "apply", "--index", "-", input=diff.encode())
    return tested, cells, carried_tests(texts)


def run_suites(
    root: Path,
    m: Manifest,
    b: Baseline,
    source: Path,
    out: Path,
    nproc: int,
    python: str,
    extra: list[str],
    timeout: int,
    say=print,
    homes: tuple[str, ...] = SUITES,
) -> int:
    """Steps 1-4 of the module docstring; writes junit files and report.md into `out`."""
    work = root / "build" / "suites" / b.name
    out.mkdir(parents=True, exist_ok=True)
    tested, cells, carried = _prepare(work, source, m, b, say)
    suites = [s for s in homes if (work / "patched" / s).exists()]
    suites += sorted(
        f for f in carried if f not in suites and not any(f.startswith(s + "/") for s in suites)
    )
    for state in STATES:
        edited = guard_te_imports(work / state, suites)
        say(f"{state}: local edit (TE import guarded) in {', '.join(edited) or 'no file'}")
    plugin_dir = work / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "mcore_fixes_rank_junit.py").write_text(RANK_PLUGIN)
    selection = sorted({n for names in carried.values() for n in names})
    runs = {
        "pristine": suites,
        "patched": suites,
        "tests-only": [*sorted(carried), "-k", " or ".join(selection)] if selection else [],
    }
    procs = {}
    logs = {}
    for state, args in runs.items():
        args = [a for a in args if a.startswith("-") or not a.startswith("tests/")
                or (work / state / a).exists()]  # fmt: skip
        if not [a for a in args if a.startswith("tests/")]:
            continue
        for old in out.glob(f"{state}.rank*.xml"):
            old.unlink()
        cmd = [
            *torchrun(python), f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", "-m", "pytest", "-p", "mcore_fixes_rank_junit",
            "-p", "no:cacheprovider", "-o", "addopts=", "-q", "-rfE",
            f"--junitxml={out / (state + '.xml')}", *extra, *args,
        ]  # fmt: skip
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(work / state), str(plugin_dir), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "PYTHONDONTWRITEBYTECODE": "1",
            "MCORE_FIXES_BASETEMP": str(work / f"tmp-{state}"),
        }
        (work / f"tmp-{state}" / "run").mkdir(parents=True, exist_ok=True)
        logs[state] = (out / f"{state}.log").open("w")
        logs[state].write("$ " + " ".join(cmd) + "\n")
        logs[state].flush()
        say(f"{state}: {' '.join(cmd[-len(args) :])[:200]}")
        procs[state] = subprocess.Popen(
            cmd,
            cwd=work / state,
            env=env,
            stdout=logs[state],
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as a whole, below
        )
    start = time.monotonic()
    rcs = {}
    for state, proc in procs.items():
        try:
            rcs[state] = proc.wait(timeout=max(1, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            rcs[state] = f"stopped after {timeout} s"
            _stop(proc)
        logs[state].close()
    outcomes = {s: read_junit(sorted(out.glob(f"{s}.rank*.xml"))) for s in procs}
    lines = report(b, nproc, cells, suites, carried, outcomes, rcs, tested)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    for line in lines:
        say(line)
    bad_diff = any(line.startswith("| ") and "REGRESSION" in line for line in lines)
    bad_carried = any(line.startswith("| ") and "NOT PROVEN" in line for line in lines)
    return 1 if bad_diff or bad_carried else 0


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT to the whole group (pytest then writes its junit file), SIGKILL if that hangs."""
    for sig, grace in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def report(b, nproc, cells, suites, carried, outcomes, rcs, tested: str = "") -> list[str]:
    pristine = outcomes.get("pristine", Outcomes())
    patched = outcomes.get("patched", Outcomes())
    tests_only = outcomes.get("tests-only", Outcomes())
    fixed = [f"fixed upstream, not applied: {c.patch}: {c.detail}" for c in cells
             if c.state == FIXED]  # fmt: skip
    lines = [
        f"# Upstream suites on {b.name}, pristine vs patched "
        f"(torchrun --nproc_per_node={nproc} -m pytest)",
        "",
        *([f"pristine: {tested}"] if tested else []),
        "patches: " + ", ".join(c.patch for c in cells if c.state == APPLIES),
        *fixed,
        "suites: " + ", ".join(suites),
        "exit status: " + ", ".join(f"{s} {rc}" for s, rc in rcs.items()),
        "",
    ]
    for name, o in (("pristine", pristine), ("patched", patched), ("tests-only", tests_only)):
        counts: dict[str, int] = {}
        for state in o.by_id.values():
            counts[state] = counts.get(state, 0) + 1
        summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no result"
        lines.append(f"- {name}: {len(o.by_id)} tests ({summary}) from {o.files} junit file(s)")
    is_carried = lambda tid: any(  # noqa: E731
        _matches(tid, path, name) for path, names in carried.items() for name in names
    )
    lines += ["", "## Tests whose outcome differs (pristine -> patched)", ""]
    diffs = []
    for tid in sorted(set(pristine.by_id) | set(patched.by_id)):
        before, after = pristine.by_id.get(tid, "absent"), patched.by_id.get(tid, "absent")
        if before == after:
            continue
        if is_carried(tid):
            verdict = "carried test"
        elif before == "passed":
            verdict = "REGRESSION"
        elif after == "passed":
            verdict = "fixed"
        else:
            verdict = "changed"
        diffs.append(f"| {tid} | {before} | {after} | {verdict} |")
    if diffs:
        lines += ["| test | pristine | patched | |", "|---|---|---|---|", *diffs]
    else:
        lines.append("none")
    lines += ["", "## Carried tests (tests-only must fail, patched must pass)", ""]
    rows = []
    for path, names in sorted(carried.items()):
        for name in sorted(names):
            ids = sorted(
                {t for t in (*tests_only.by_id, *patched.by_id) if _matches(t, path, name)}
            )
            if not ids:
                rows.append(f"| {path}::{name} | not collected | not collected | NOT PROVEN |")
            for tid in ids:
                before = tests_only.by_id.get(tid, "absent")
                after = patched.by_id.get(tid, "absent")
                if after == "skipped":
                    verdict = "skipped (needs more ranks or hardware)"
                elif after == "passed" and before in ("failed", "error"):
                    verdict = "proven"
                elif after == "passed" and before == "passed":
                    verdict = "passes unpatched (compatibility)"
                else:
                    verdict = "NOT PROVEN"
                rows.append(f"| {tid} | {before} | {after} | {verdict} |")
    lines += ["| test | tests-only | patched | verdict |", "|---|---|---|---|", *rows]
    return lines


def default_python() -> str:
    return sys.executable
