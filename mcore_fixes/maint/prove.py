"""`prove`: each patch must fail its proof on the tree just before it and pass right after it.

A patch's proof is our CPU proof file (manifest key `proof`, under tests/proofs/), run against
the tree with cwd = the tree and PYTHONPATH = the tree. A patch without one is proven with the
tests/ files it carries (applied to the tree without the fix for the `before` run).

One pytest process per tree state: the `after` proof of patch k and the `before` proof of patch
k+1 run on the same commit, so they share one process and one `import megatron.core`; outcomes
per file come from `--junitxml`. A process that dies without a report (a crash) is retried one
file at a time, so one bad file never hides the others' results. Each process is a fork of a
server that has imported torch and pytest once per job, never megatron (forkserver.py);
MCORE_FIXES_FORK_SERVER=0 starts a fresh interpreter per tree state instead.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import json
import os
import re
import subprocess
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from .. import git
from ..errors import UserError
from ..manifest import Baseline, Manifest
from ..progress import Progress
from ..series import (
    APPLIES,
    CONFLICT,
    FIXED,
    UPSTREAM,
    Cell,
    apply_series,
    diff_sha256,
    patch_arg,
    read_patch,
    test_files,
)
from . import forkserver
from .forkserver import ForkServer, Gone, run_fresh
from .pytests import pytest_command
from .stack import alone

PROOFS_DIR = Path("build") / "proofs"
_SUMMARY = re.compile(r"\b\d+ (passed|failed|errors?|skipped|deselected)\b|no tests ran")
TIMEOUT = int(os.environ.get("MCORE_FIXES_PROOF_TIMEOUT", "900"))  # seconds per pytest process


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


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}


def _proof_env(tree: Path) -> dict[str, str]:
    """A proof process's environment: it reads and writes bytecode (see precompile)."""
    env = _env(tree)
    del env["PYTHONDONTWRITEBYTECODE"]
    return env


def precompile(tree: Path, python: str, revs: list[str]) -> None:
    """Bytecode of the tree's megatron/ at each of `revs`, checked by source hash.

    Proof processes then import megatron from bytecode (~0.45 s of compiling each). Tree states
    differ by a checkout, whose file times say nothing safe (two contents may share a second and
    a size): CPython rewrites a hash-checked .pyc whose source changed as hash-checked again, so
    every file of the pristine or the patched tree is checked by its content. The bytecode stays
    across checkouts (`_checkout`) and goes when prove is done. Best effort: a failure only costs
    the compile time back.
    """
    for rev in revs:
        _checkout(tree, rev)
        cmd = [python, "-m", "compileall", "-q", "-f", "-j", "0"]
        cmd += ["--invalidation-mode", "checked-hash", "megatron"]
        subprocess.run(cmd, cwd=tree, env=_proof_env(tree), capture_output=True, timeout=TIMEOUT)


def run_tests(tree: Path, files: list[str], python: str) -> dict:
    """Run `files` with the tree on PYTHONPATH; outcome is passed / failed / error / no-tests."""
    try:
        proc = subprocess.run(
            pytest_command(python, files),
            cwd=tree,
            env=_env(tree),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return {"outcome": "error", "rc": None, "summary": f"timed out after {TIMEOUT} s"}
    lines = [ln.strip("= ") for ln in proc.stdout.splitlines() if _SUMMARY.search(ln)]
    summary = lines[-1] if lines else (proc.stderr.strip().splitlines() or [""])[-1]
    outcome = {0: "passed", 1: "failed", 5: "no-tests"}.get(proc.returncode, "error")
    return {"outcome": outcome, "rc": proc.returncode, "summary": summary}


@dataclass
class Runs:
    """What the pytest processes of a prove run cost (for the CI floor in docs/evidence.md)."""

    processes: int = 0
    forks: int = 0  # of `processes`: forks of a fork server (the others: fresh interpreters)
    seconds: float = 0.0
    files: int = 0
    startup: float = 0.0  # of `seconds`: start or fork + import torch (fresh), megatron.core
    servers: int = 0  # fork servers started
    server_seconds: float = 0.0  # their interpreter starts + preloads (torch, pytest, ...)
    log: list[dict] = field(default_factory=list)
    legacy: int = 0  # processes of patches without a proof (their carried tests)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def summary(self) -> str:
        total = self.processes + self.legacy
        servers = (
            f"; {self.forks} forked from {self.servers} fork servers, which took "
            f"{self.server_seconds:.1f} s to start and preload torch"
            if self.servers
            else ""
        )
        return (
            f"prove: {total} pytest processes ({self.processes} for our proofs: "
            f"{self.files} proof runs, {self.seconds:.1f} s, of which {self.startup:.1f} s "
            f"starts + imports{servers})"
        )

    def as_json(self) -> dict:
        return {
            "processes": self.processes,
            "forks": self.forks,
            "legacy_processes": self.legacy,
            "proof_runs": self.files,
            "seconds": round(self.seconds, 2),
            "startup_seconds": round(self.startup, 2),
            "servers": self.servers,
            "server_seconds": round(self.server_seconds, 2),
            "log": self.log,
        }


def _file_results(junit: Path, root: Path, files: list[str]) -> dict[str, dict]:
    """Per proof file (absolute path): outcome and summary, from a pytest junit XML report."""
    counts: dict[str, dict[str, int]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        rel = case.get("file") or ""
        path = str((root / rel).resolve()) if rel else ""
        c = counts.setdefault(path, {"failed": 0, "passed": 0, "skipped": 0, "collect": 0})
        kinds = {child.tag for child in case}
        if "error" in kinds and not case.get("classname"):
            c["collect"] += 1  # the module did not import
        elif kinds & {"failure", "error"}:
            c["failed"] += 1
        elif "skipped" in kinds:
            c["skipped"] += 1
        else:
            c["passed"] += 1
    results: dict[str, dict] = {}
    for f in files:
        c = counts.get(str(Path(f).resolve()))
        if c is None:
            continue
        parts = [f"{n} {k}" for k, n in c.items() if n and k != "collect"]
        if c["collect"]:
            outcome, parts = "error", ["does not import (collection error)"]
        elif c["failed"]:
            outcome = "failed"
        elif c["passed"]:
            outcome = "passed"
        else:
            outcome = "no-tests"
        results[f] = {"outcome": outcome, "summary": ", ".join(parts) or "no tests ran"}
    return results


# `python -c BOOTSTRAP pytest-args...`: pytest, after timing what every proof process pays
# first (its fork, or interpreter start + `import torch`; `import megatron.core` from the
# tree): with the fork servers' starts, the CI floor. Once pytest has written its report, the
# process ends at once: the interpreter's shutdown (~1.5 s with torch loaded) decides nothing.
BOOTSTRAP = """\
import os, sys, time
try:
    import megatron.core  # and torch, which it imports
except Exception:
    pass  # pytest reports it, per file
with open(os.environ["MCORE_FIXES_STARTUP"], "w") as f:
    f.write(str(time.time() - float(os.environ["MCORE_FIXES_T0"])))
import pytest
rc = int(pytest.main(sys.argv[1:]))
sys.stdout.flush()
sys.stderr.flush()
os._exit(rc)
"""


def run_proofs(
    tree: Path,
    files: list[str],
    python: str,
    root: Path,
    runs: Runs,
    server: ForkServer | None = None,
) -> dict:
    """Run proof `files` (absolute) in one pytest process on `tree`; a result per file.

    The process is a fork of `server` (see forkserver.py) if there is one that still serves,
    a fresh interpreter otherwise.
    """
    with tempfile.TemporaryDirectory(prefix="mcore-fixes-junit.") as tmp:
        junit = Path(tmp) / "junit.xml"
        startup = Path(tmp) / "startup"
        cmd = pytest_command(python, files)
        cmd[1:3] = ["-c", BOOTSTRAP]
        cmd[3:3] = [
            "--continue-on-collection-errors",
            "-p",  # its gc.collect() passes at exit (~0.5 s) only turn leaks into warnings
            "no:unraisableexception",
            f"--rootdir={root}",
            "-o",
            "junit_family=xunit1",
            f"--junitxml={junit}",
        ]
        env = _proof_env(tree) | {
            "MCORE_FIXES_STARTUP": str(startup),
            "MCORE_FIXES_T0": str(time.time()),
        }
        start = time.monotonic()
        log = Path(tmp) / "log"
        rc, forked = _run(server, cmd, tree, env, log)
        took = time.monotonic() - start
        boot = float(startup.read_text()) if startup.is_file() else 0.0
        with runs.lock:
            runs.processes += 1
            runs.forks += forked
            runs.seconds += took
            runs.startup += boot
            runs.files += len(files)
            runs.log.append(
                {
                    "files": len(files),
                    "seconds": round(took, 2),
                    "startup": round(boot, 2),
                    "forked": forked,
                }
            )
        results = _file_results(junit, root, files) if junit.exists() else {}
    missing = [f for f in files if f not in results]
    if missing and len(files) > 1:  # the process died: each file alone, to tell which
        for f in missing:
            results |= run_proofs(tree, [f], python, root, runs, server)
    for f in missing if len(files) == 1 else []:
        why = f"timed out after {TIMEOUT} s" if rc is None else f"pytest died (exit {rc})"
        results[f] = {"outcome": "error", "summary": why}
    return results


def _run(
    server: ForkServer | None, cmd: list[str], tree: Path, env: dict[str, str], log: Path
) -> tuple[int | None, bool]:
    """Exit status of `cmd` (`python -c CODE ARGS`; None: timed out), and whether it ran as a
    fork of `server` (else as a fresh interpreter)."""
    if server is not None and server.alive:
        try:
            return server.run(cmd[2], cmd[3:], tree, env, log, TIMEOUT), True
        except Gone:
            pass  # it died or refused: a fresh interpreter, as without one
    return run_fresh(cmd, tree, env, log, TIMEOUT), False


def verdict(before: dict, after: dict, strict: bool = False) -> str:
    """`strict` (our proofs): a proof that does not import before the patch is not a proof."""
    if before["outcome"] == "passed":
        return "passes-unpatched"  # already fixed upstream, or a test that cannot fail
    if after["outcome"] != "passed":
        return "fails-patched"
    if before["outcome"] == "failed" or (before["outcome"] == "error" and not strict):
        return "proven"
    if before["outcome"] == "error":
        return "no-import-unpatched"
    return "no-proof"


class Servers:
    """The fork servers of a prove run: one per thread, for the baselines it proves one after
    the other (a server holds nothing of any tree: checked before every fork)."""

    def __init__(self, python: str, runs: Runs) -> None:
        self.python, self.runs = python, runs
        self._local = threading.local()
        self._started: list[ForkServer] = []

    def get(self, tree: Path) -> ForkServer | None:
        """This thread's server, started in `tree` if it has none; None: fresh interpreters."""
        server = getattr(self._local, "server", None)
        if server is None and forkserver.enabled() and not getattr(self._local, "no", False):
            try:
                server = ForkServer(self.python, tree, _env(tree), TIMEOUT)
            except Gone:
                self._local.no = True
                return None
            self._local.server = server
            with self.runs.lock:
                self._started.append(server)
                self.runs.servers += 1
                self.runs.server_seconds += server.seconds
        return server if server is not None and server.alive else None

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self._started:
            server.close()


def _checkout(tree: Path, rev: str) -> None:
    git.run(tree, "checkout", "-q", "-f", "--detach", rev)
    git.run(tree, "clean", "-q", "-fdx", "-e", "__pycache__")  # see precompile


def prove_baseline(
    root: Path,
    manifest: Manifest,
    b: Baseline,
    tree: Path,
    python: str,
    only: list[str] | None,
    progress: Progress,
    runs: Runs | None = None,
    changed: bool = False,
    alone: bool = False,
    servers: Servers | None = None,
) -> list[Cell]:
    """Prove every applicable patch of `b` (or those in `only`); results go to build/proofs/.

    `changed`: keep the stored proofs that still hold (same pin, diffs and proof code) and
    prove only the others. `alone`: each commit stands alone: the proof fails on the pristine
    tree plus only the patch's declared requires and passes with the patch added (a patch that
    does not apply there is `not-alone`); stored apart (build/proofs/<baseline>.alone.json).
    `servers`: the run's fork servers (else one for this baseline).
    """
    check_python(python)
    runs = runs if runs is not None else Runs()
    cells = apply_series(tree, manifest, b)
    head = git.out(tree, "rev-parse", "HEAD")
    store = {} if alone else load_proofs(root, b.name)
    keys = proof_keys(manifest, cells)
    states = _alone_states(tree, manifest, cells) if alone else {}
    if changed and not alone:
        attach_proofs(root, manifest, b, cells)
        held = {c.patch for c in cells if c.proof}
        only = [c.patch for c in cells if c.patch not in held and (not only or c.patch in only)]
        if not only:
            progress.step(f"{b.name}: every stored proof still holds", long=True)
            _checkout(tree, head)
            return cells
    # Tree state (commit) -> proof files to run there, in series order.
    plan: dict[str, list[str]] = {}
    ours: list[tuple[Cell, str, str, str]] = []  # cell, proof file, before, after commit
    legacy: list[Cell] = []
    # does not apply (has upstream fixed it?) or reverse-applies (does upstream's code pass?)
    unapplied: list[tuple[Cell, str]] = []
    for cell in cells:
        if cell.state not in JUDGED or (only and cell.patch not in only):
            continue
        proof = manifest.proof_path(manifest.patch(cell.patch))
        if proof is not None and cell.state != APPLIES:
            if proof.is_file() and cell.base:
                plan.setdefault(cell.base, [])
                if str(proof) not in plan[cell.base]:
                    plan[cell.base].append(str(proof))
                unapplied.append((cell, str(proof)))
            continue
        if cell.state != APPLIES:
            continue
        if proof is None:
            legacy.append(cell)
            continue
        if not proof.is_file():
            cell.proof = {"verdict": "no-proof-file", "tests": [_rel(root, proof)]}
            continue
        if alone and isinstance(states[cell.patch], str):
            cell.proof = {"verdict": "not-alone", "detail": states[cell.patch]}
            continue
        parent, commit = states[cell.patch] if alone else (_parent(tree, cell), cell.commit)
        for state in (parent, commit):
            files = plan.setdefault(state, [])
            if str(proof) not in files:
                files.append(str(proof))
        ours.append((cell, str(proof), parent, commit))

    start = time.monotonic()
    if plan:
        precompile(tree, python, ["pristine", head])
    count = len(ours) + len(unapplied) + len(legacy)
    progress.step(f"{b.name}: proving {count} patch(es)", long=True)
    results: dict[tuple[str, str], dict] = {}
    with contextlib.nullcontext(servers) if servers else Servers(python, runs) as pool:
        server = pool.get(tree) if plan else None
        for state, files in plan.items():
            _checkout(tree, state)
            names = ", ".join(Path(f).stem for f in files)
            progress.step(f"{b.name} @ {_label(cells, state)}: {names}", long=True)
            for f, result in run_proofs(tree, files, python, root, runs, server).items():
                results[(state, f)] = result
    for cell, proof, parent, commit in ours:
        before, after = results[(parent, proof)], results[(commit, proof)]
        cell.proof = {
            "verdict": verdict(before, after, strict=True),
            "before": before,
            "after": after,
            "tests": [_rel(root, Path(proof))],
        }

    for cell, proof in unapplied:
        before = results[(cell.base, proof)]
        cell.proof = {"verdict": judge_unapplied(cell, before), "before": before}
        cell.proof["tests"] = [_rel(root, Path(proof))]

    for cell in legacy:
        path = manifest.root / cell.file
        tests = test_files(read_patch(path))
        if not tests or cell.excluded:  # no test, or its tests edit files this tree lacks
            cell.proof = {"verdict": "no-test"}
        elif alone and isinstance(states[cell.patch], str):
            cell.proof = {"verdict": "not-alone", "detail": states[cell.patch]}
        else:
            parent, commit = states[cell.patch] if alone else (_parent(tree, cell), cell.commit)
            _checkout(tree, parent)
            git.run(tree, "apply", "--include=tests/*", patch_arg(path))
            progress.step(f"{b.name} {cell.patch}: tests without the fix", long=True)
            before = run_tests(tree, tests, python)
            _checkout(tree, commit)
            progress.step(f"{b.name} {cell.patch}: tests with the fix", long=True)
            after = run_tests(tree, tests, python)
            with runs.lock:
                runs.legacy += 2
            cell.proof = {"verdict": verdict(before, after), "before": before, "after": after}
            cell.proof["tests"] = tests
    for cell in cells:
        if cell.proof:
            cell.proof |= {"key": keys.get(cell.patch, ""), "pin": b.pin}
            store[cell.patch] = cell.proof
    verdicts = collections.Counter(c.proof["verdict"] for c in cells if c.proof)
    done = ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items())) or "nothing to prove"
    progress.step(f"{b.name}: {done} ({time.monotonic() - start:.0f} s)", long=True)
    _checkout(tree, head)
    git.run(tree, "clean", "-q", "-fdx")  # the bytecode too: the tree as the series left it
    out = root / PROOFS_DIR / f"{b.name}{'.alone' if alone else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(store, indent=1) + "\n")
    return cells


def _parent(tree: Path, cell: Cell) -> str:
    return git.out(tree, "rev-parse", f"{cell.commit}^")


def _alone_states(tree: Path, manifest: Manifest, cells: list[Cell]) -> dict[str, tuple | str]:
    """Per applied patch: (commit of pristine + its requires, that + the patch), made in the
    tree repository from mcore_fixes.stack's trees; or why it does not stand alone."""
    states: dict[str, tuple | str] = {}
    for a in alone(tree, manifest, cells):
        if a.state != "ok":
            states[a.patch] = a.detail
            continue
        env = git.TOOL_IDENTITY
        pristine = git.out(tree, "rev-parse", "pristine")
        base = git.out(tree, "commit-tree", a.base, "-p", pristine, "-m", "requires", env=env)
        after = git.out(tree, "commit-tree", a.tree, "-p", base, "-m", a.patch, env=env)
        states[a.patch] = (base, after)
    return states


def _rel(root: Path, path: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def _label(cells: list[Cell], commit: str) -> str:
    for cell in cells:
        if cell.commit == commit:
            return f"after {cell.patch}"
    return "pristine"


def _proof_sha(manifest: Manifest, patch_id: str) -> str:
    """The proof file and the shared helpers next to it (`_*.py`): a proof is also its code."""
    proof = manifest.proof_path(manifest.patch(patch_id))
    if proof is None or not proof.is_file():
        return ""
    h = hashlib.sha256(proof.read_bytes())
    for helper in sorted(proof.parent.glob("_*.py")):
        h.update(helper.name.encode() + b"\0" + helper.read_bytes())
    return h.hexdigest()


# Cell states whose proof prove runs: applied ones before and after the patch, the others
# (judge_unapplied) once, on the tree without the patch.
JUDGED = (APPLIES, FIXED, CONFLICT, UPSTREAM)


def judge_unapplied(cell: Cell, before: dict) -> str:
    """A patch that does not apply, judged by its proof on the tree without it.

    Its proof passes: upstream fixed it its own way (`fixed-upstream`, also where the manifest
    does not record it yet). It fails: a manifest claim of `fixed-upstream` is refuted and the
    cell is a `conflict` again; a plain conflict stays one. A patch that reverse-applies
    (`applied-upstream`, e.g. upstream's own commit carried for the releases, on main): its
    proof must pass on upstream's code as it is, or the claim is refuted.
    """
    passes = before["outcome"] == "passed"
    if cell.state == UPSTREAM:
        return "applied-upstream" if passes else "applied-upstream-refuted"
    if passes:
        if cell.state == CONFLICT:
            cell.state = FIXED
            cell.detail = (
                f"its proof passes without it (patch {cell.detail}); record upstream's commit "
                "in the manifest's fixed-upstream table"
            )
        return "fixed-upstream"
    if cell.state == FIXED:
        cell.state = CONFLICT
        cell.detail = f"the manifest says fixed upstream, but its proof fails: {cell.detail}"
        return "fixed-upstream-refuted"
    return "fails-unpatched"


def proof_keys(manifest: Manifest, cells: list[Cell]) -> dict[str, str]:
    """Per patch, a hash of its diff, the diffs applied before it, and its proof code.

    A proof depends on the code it ran on: the messages of the patches do not count.
    """
    keys: dict[str, str] = {}
    running = hashlib.sha256()
    for cell in cells:
        path = manifest.root / cell.file if cell.file else None
        if path is None or not path.is_file():
            continue
        own = diff_sha256(path)
        if cell.state == APPLIES:
            running.update(own.encode())
        key = running.hexdigest() + own + _proof_sha(manifest, cell.patch)
        keys[cell.patch] = hashlib.sha256(key.encode()).hexdigest()
    return keys


def load_proofs(root: Path, baseline: str) -> dict:
    path = root / PROOFS_DIR / f"{baseline}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def attach_proofs(root: Path, manifest: Manifest, b: Baseline, cells: list[Cell]) -> None:
    """Attach stored proofs to cells, only where the baseline, the diffs and proofs are unchanged.

    A patch that does not apply takes its state from its stored proof (see judge_unapplied).
    """
    store = load_proofs(root, b.name)
    keys = proof_keys(manifest, cells)
    for cell in cells:
        proof = store.get(cell.patch)
        if not proof or cell.state not in JUDGED:
            continue
        if proof.get("pin") != b.pin or proof.get("key") != keys.get(cell.patch):
            continue
        if cell.state == APPLIES and "after" in proof:
            cell.proof = proof
        elif cell.state != APPLIES and "after" not in proof and "before" in proof:
            judge_unapplied(cell, proof["before"])
            cell.proof = proof
