"""`prove`'s processes: forks of a server that never imports megatron, each importing it from
its own tree state only, with the results of fresh interpreters; a hung proof is killed with
what it forked; and `prove` says what it is doing when its output is not a terminal."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from toolworld import commit_all, git, write

from mcore_fixes.maint import forkserver, prove

# Appended to the fix-mean proof (runs on the pristine tree and after fix-mean): where it ran.
WHERE = """

import json as _json
import os as _os
import sys as _sys


def test_where_it_runs():
    modules = {
        name: getattr(mod, "__file__", None)
        for name, mod in _sys.modules.items()
        if name.split(".")[0] == "megatron"
    }
    record = {
        "pid": _os.getpid(),
        "ppid": _os.getppid(),
        "pgid": _os.getpgid(0),
        "cwd": _os.getcwd(),
        "path": _sys.path,
        "argv0": _sys.argv[0],
        "megatron": modules,
        "modules": sorted(_sys.modules),
    }
    with open(_os.environ["WHERE_LOG"], "a") as f:
        f.write(_json.dumps(record) + "\\n")
"""

# Unpatched, the fix-mean proof forks a helper (as the proofs fork their ranks), then hangs.
HANG = """

import os as _os
import time as _time


def test_hangs_unpatched():
    if mean([1, 2, 3]) == 2:
        return
    pid = _os.fork()
    if pid == 0:
        _time.sleep(600)
        _os._exit(0)
    with open(_os.environ["WHERE_LOG"], "a") as f:
        f.write(f"{pid}\\n")
    _time.sleep(600)
"""


@pytest.fixture
def where(project, tmp_path, monkeypatch) -> Path:
    log = tmp_path / "where.jsonl"
    monkeypatch.setenv("WHERE_LOG", str(log))
    return log


def _append_to_proof(project: Path, code: str) -> None:
    proof = project / "tests/proofs/test_fix_mean.py"
    proof.write_text(proof.read_text() + code)


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _outcomes(project: Path) -> dict:
    """Our proofs' results (weak-test's carried tests report their run time)."""
    store = json.loads((project / "build/proofs/0.1.0.json").read_text())
    return {
        k: (v["verdict"], v.get("before"), v.get("after"))
        for k, v in store.items()
        if k != "weak-test"
    }


def test_each_tree_state_is_a_fork_that_imports_only_its_tree(project, tool, where, monkeypatch):
    _append_to_proof(project, WHERE)
    tree = project / "build/trees/0.1.0"
    args = ("prove", "--python", sys.executable, "--baseline", "0.1.0")
    r = tool(project, *args)
    assert r.rc == 1, r.err  # weak-test's own test cannot fail
    # 3 tree states for our proofs; weak-test's carried tests run the old way (2 more)
    assert "3 forked from 1 fork servers" in r.err
    forked = _records(where)
    assert len(forked) == 2  # the pristine tree and the tree after fix-mean
    assert len({rec["pid"] for rec in forked}) == 2
    assert len({rec["ppid"] for rec in forked}) == 1  # one server for the baseline
    for rec in forked:
        assert rec["ppid"] != os.getpid()  # not a child of this (the tool's) process
        assert rec["pgid"] == rec["pid"]  # its own process group
        assert rec["cwd"] == str(tree) and rec["argv0"] == "-c"
        i = rec["path"].index("")  # as `python -c` with PYTHONPATH=tree has it
        assert rec["path"][i + 1] == str(tree)
        assert "megatron.core.calc" in rec["megatron"]
        for name, file in rec["megatron"].items():
            assert file is None or file.startswith(str(tree) + os.sep), (name, file)
    outcomes = _outcomes(project)

    # Fresh interpreters (the fallback): the same results, the same view of the tree.
    where.unlink()
    monkeypatch.setenv("MCORE_FIXES_FORK_SERVER", "0")
    r = tool(project, *args)
    assert r.rc == 1 and "fork server" not in r.err
    fresh = _records(where)
    assert len(fresh) == 2 and all(rec["ppid"] == os.getpid() for rec in fresh)
    for rec, fork in zip(fresh, forked, strict=True):
        assert rec["pgid"] == rec["pid"]
        for key in ("cwd", "path", "argv0", "megatron", "modules"):
            assert rec[key] == fork[key], key
    assert _outcomes(project) == outcomes


def test_one_server_per_job_for_the_baselines_it_proves(world, project, tool, where):
    _append_to_proof(project, WHERE)
    args = ("prove", "--python", sys.executable, "--patch", "fix-mean", "--jobs", "1")
    baselines = ("--baseline", "0.1.0", "--baseline", "core_v0.1.1")
    r = tool(project, *args, *baselines, "--mcore-repo", world.upstream)
    assert r.rc == 0, r.err
    assert "4 forked from 1 fork servers" in r.err
    forked = _records(where)
    assert len(forked) == 4 and len({rec["ppid"] for rec in forked}) == 1
    trees = {project / "build/trees" / name for name in ("0.1.0", "core_v0.1.1")}
    assert {Path(rec["cwd"]) for rec in forked} == trees
    for rec in forked:  # each imports megatron from its own tree only
        assert all(f is None or f.startswith(rec["cwd"] + os.sep) for f in rec["megatron"].values())


def test_a_server_that_imported_the_tree_is_not_used(project, tool, where, monkeypatch):
    """A preload that reaches into the tree (here megatron itself): fresh interpreters."""
    _append_to_proof(project, WHERE)
    monkeypatch.setattr(forkserver, "PRELOAD", ("pytest", "megatron.core.calc"))
    args = ("prove", "--python", sys.executable, "--baseline", "0.1.0", "--patch", "fix-mean")
    r = tool(project, *args)
    assert r.rc == 0, r.err
    assert "fork server" not in r.err
    assert all(rec["ppid"] == os.getpid() for rec in _records(where))
    assert _outcomes(project)["fix-mean"][0] == "proven"


@pytest.mark.parametrize("server", ["1", "0"])
def test_a_hung_proof_is_killed_with_what_it_forked(project, tool, where, monkeypatch, server):
    _append_to_proof(project, HANG)
    monkeypatch.setenv("MCORE_FIXES_FORK_SERVER", server)
    monkeypatch.setattr(prove, "TIMEOUT", 6)
    args = ("prove", "--python", sys.executable, "--baseline", "0.1.0", "--patch", "fix-mean")
    r = tool(project, *args)
    assert r.rc == 1
    verdict, before, after = _outcomes(project)["fix-mean"]
    assert verdict == "no-import-unpatched"  # what a proof that errors unpatched gets
    assert before == {"outcome": "error", "summary": "timed out after 6 s"}
    assert after == {"outcome": "passed", "summary": "2 passed"}
    if not where.exists():
        pytest.skip("the machine is too busy: the proof did not fork its helper within 6 s")
    (helper,) = map(int, where.read_text().split())
    assert not _running(helper)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_prove_reports_progress_when_output_is_not_a_terminal(project, tool):
    """A line per baseline and per tree state, timestamped, also in a CI log or a pipe."""
    assert not sys.stderr.isatty()
    r = tool(project, "prove", "--python", sys.executable, "--baseline", "0.1.0")
    lines = r.err.splitlines()
    stamp = r"^\[ *\d+\.\ds\] "
    assert all(re.match(stamp, line) for line in lines[:-1]), lines  # the last: the summary
    steps = [re.sub(stamp, "", line) for line in lines[:-1]]
    assert steps[0] == "0.1.0: proving 3 patch(es)"
    assert steps[1:4] == [
        "0.1.0 @ pristine: test_fix_mean",
        "0.1.0 @ after fix-mean: test_fix_mean, test_join_sep",
        "0.1.0 @ after join-sep: test_join_sep",
    ]
    assert steps[4:6] == [
        "0.1.0 weak-test: tests without the fix",
        "0.1.0 weak-test: tests with the fix",
    ]
    assert re.fullmatch(r"0\.1\.0: 1 passes-unpatched, 2 proven \(\d+ s\)", steps[6])
    # Short verbs stay quiet.
    assert tool(project, "status", "--baseline", "0.1.0").err == ""


def test_bytecode_follows_each_state_even_at_one_size_and_second(tmp_path):
    """Two tree states whose module has one size, checked out within one second (its mtime
    set alike): each proof process still runs its own state's code, not the other's bytecode."""
    tree = tmp_path / "tree"
    write(tree, "megatron/m.py", "X = 1\n")
    git(tmp_path, "init", "-q", str(tree))
    commit_all(tree, "one")
    git(tree, "tag", "pristine")
    write(tree, "megatron/m.py", "X = 2\n")
    commit_all(tree, "two")
    head = git(tree, "rev-parse", "HEAD").strip()
    prove.precompile(tree, sys.executable, ["pristine", head])
    seen = []
    for rev in ("pristine", head, "pristine", head):
        prove._checkout(tree, rev)
        os.utime(tree / "megatron/m.py", (1_700_000_000, 1_700_000_000))
        code = "import megatron.m, sys; print(megatron.m.X)"
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=tree, env=prove._proof_env(tree),
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        seen.append(proc.stdout.strip())
    assert seen == ["1", "2", "1", "2"]
    assert list((tree / "megatron" / "__pycache__").glob("m.*.pyc"))  # it did use bytecode
