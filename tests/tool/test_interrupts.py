"""Killed, interrupted and concurrent runs: completed or fully undone; the next run recovers.

A `git` wrapper first on PATH stops the real tool (a subprocess) right before the first call of
a chosen git command, so that it is killed (or sent SIGINT) exactly there.

The tool starts with SIGINT/SIGTERM unblocked and SIGINT at its default, whatever the test
process has (masks and ignored signals are inherited across fork and exec): a Ctrl-C test must
not depend on the state a pytest worker happens to be in. A Ctrl-C that the tool does not act
on fails within the timeout, with the signal state of the tool and its children (from /proc).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from toolworld import MAIN, git, run_module, snapshot

GIT = shutil.which("git")
# In Python, not sh: dash unblocks the signals it inherits, git does not.
WRAPPER = f"""#!{sys.executable} -S
import os, sys, time
if f" {{os.environ['STOP_AT']}} " in f" {{' '.join(sys.argv[1:])}} ":
    try:  # the first such call only: an interrupt the tool missed cannot add up the stops
        os.close(os.open(os.environ["REACHED"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        time.sleep(float(os.environ["STOP_FOR"]))
    except FileExistsError:
        pass
os.execv(os.environ["REAL_GIT"], ["git", *sys.argv[1:]])
"""
# The tool, started with a clean signal state (see the module docstring).
LAUNCH = """import runpy, signal, sys
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
sys.argv = ["mcore_fixes", *sys.argv[1:]]
runpy.run_module("mcore_fixes", run_name="__main__", alter_sys=True)
"""


def wrapped_env(tmp_path: Path, stop_at: str, stop_for: int = 30) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "git").write_text(WRAPPER)
    (bin_dir / "git").chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "REAL_GIT": GIT,
        "STOP_AT": stop_at,
        "STOP_FOR": str(stop_for),
        "REACHED": str(tmp_path / f"reached-{stop_at.replace(' ', '_')}"),
    }


def start(root: Path, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "--root", str(root), *map(str, args)],
        cwd=MAIN,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: kill it and its git children
    )


def wait_reached(env: dict[str, str], proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not Path(env["REACHED"]).exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached the stop"
        time.sleep(0.02)


def signal_state(pid: int) -> str:
    """SigBlk/SigIgn/SigPnd of `pid` and its children (Linux /proc), for a failure message."""
    lines = []
    for p in [pid, *_children(pid)]:
        try:
            status = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        keep = [
            ln for ln in status if ln.startswith(("Name", "SigBlk", "SigIgn", "SigPnd", "ShdPnd"))
        ]
        lines.append(f"{p}: " + " ".join(" ".join(ln.split()) for ln in keep))
    return "\n".join(lines)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def interrupt(proc: subprocess.Popen[str], timeout: int = 60) -> tuple[str, str]:
    """Ctrl-C to the tool's process group; its output once it exited."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        state = signal_state(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        why = f"the tool did not act on SIGINT within {timeout} s:\n{state}"
        raise AssertionError(why) from None


def count(co: Path) -> int:
    return int(git(co, "rev-list", "--count", "core_v0.1.0..HEAD"))


def state_dir(co: Path) -> Path:
    return Path(git(co, "rev-parse", "--absolute-git-dir").strip()) / "mcore-fixes"


@pytest.mark.parametrize("stop_at", ["commit-tree", "read-tree -m -u", "update-ref"])
def test_apply_killed_anywhere_is_undone_or_completed_by_the_next_run(
    world, project, tmp_path, stop_at
):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    before = snapshot(co)
    env = wrapped_env(tmp_path, stop_at)
    proc = start(project, "apply", co, env=env)
    wait_reached(env, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    after_kill = snapshot(co)
    if stop_at != "update-ref":
        assert after_kill == before  # killed before the checkout moved: nothing happened
    else:  # killed between the two steps: files and index moved, HEAD not yet
        assert after_kill["head"] == before["head"] and count(co) == 0
    for path in (co / ".git").rglob("*.lock"):
        raise AssertionError(f"lock left: {path}")

    r = run_module(project, "apply", co)
    assert r.rc == 0, r.err
    assert count(co) == 3
    assert git(co, "status", "--porcelain", "--untracked-files=all").strip() == ""
    assert not state_dir(co).exists()
    if stop_at == "update-ref":
        assert "an interrupted apply was completed" in r.out
        assert "nothing to do" not in r.out or r.out.count("already applied") == 3


def test_apply_ctrl_c_in_the_critical_step_completes(world, project, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    env = wrapped_env(tmp_path, "read-tree -m -u", stop_for=1)
    proc = start(project, "apply", co, env=env)
    wait_reached(env, proc)
    out, err = interrupt(proc)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and out.count(": committed") == 3
    assert count(co) == 3 and git(co, "status", "--porcelain").strip() == ""
    assert not state_dir(co).exists()


def test_apply_ctrl_c_while_checking_changes_nothing(world, project, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    before = snapshot(co)
    env = wrapped_env(tmp_path, "commit-tree")
    proc = start(project, "apply", co, env=env)
    wait_reached(env, proc)
    out, err = interrupt(proc)
    assert proc.returncode == 130, out + err
    assert err.strip() == "mcore_fixes: interrupted"
    assert snapshot(co) == before
    assert not state_dir(co).exists()


def test_two_concurrent_applies(world, project, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    env = wrapped_env(tmp_path, "commit-tree", stop_for=1)
    first = start(project, "apply", co, env=env)
    wait_reached(env, first)
    second = start(project, "apply", co, env={**env, "STOP_AT": "no-such-command"})
    out2, err2 = second.communicate(timeout=60)
    out1, err1 = first.communicate(timeout=60)
    assert first.returncode == 0 and second.returncode == 0, err1 + err2
    assert out1.count(": committed") == 3
    assert "waiting for another mcore_fixes run" in err2
    assert "nothing to do" in out2 and out2.count(": already applied") == 3
    assert count(co) == 3 and git(co, "status", "--porcelain").strip() == ""


def test_apply_without_identity_and_a_conflict_midway(world, project, tmp_path):
    """No user.name/email anywhere and patch 2 of 3 conflicts: nothing committed, nothing left."""
    co = world.clone(tmp_path / "co", "core_v0.3.0")
    git(co, "checkout", "-q", "-B", "work", "core_v0.1.0")
    util = co / "megatron/core/util.py"
    util.write_text(util.read_text().replace("Join names", "Join the names"))
    git(co, "commit", "-qam", "local change under join-sep")
    before = snapshot(co)
    empty = tmp_path / "empty-gitconfig"
    empty.write_text("")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": str(empty), "HOME": str(tmp_path), "EMAIL": ""}
    r = run_module(project, "apply", co, env=env)
    assert r.rc == 1 and "join-sep" in r.err and "left unchanged" in r.err
    assert snapshot(co) == before and not state_dir(co).exists()
    assert not (co / ".git" / "rebase-apply").exists()


def test_status_killed_inside_a_tree_recovers(world, project, tmp_path):
    """A run killed in `git am` in build/trees leaves am state and locks: the next run copes."""
    env = wrapped_env(tmp_path, "am")
    proc = start(project, "status", "--baseline", "0.1.0", env=env)
    wait_reached(env, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    tree = project / "build" / "trees" / "0.1.0"
    (tree / ".git" / "rebase-apply").mkdir(exist_ok=True)
    (tree / ".git" / "index.lock").write_text("")
    (tree / ".git" / "refs" / "heads" / "main.lock").write_text("")
    for args in (("status", "--baseline", "0.1.0"), ("vendor", "--force"), ("vendor",)):
        r = run_module(project, *args)
        assert r.rc == 0, r.err
    assert not (tree / ".git" / "rebase-apply").exists()
    assert not list((tree / ".git").glob("*.lock"))


def test_apply_after_git_was_killed_holding_the_index_lock(world, project, tmp_path):
    """git killed inside `read-tree -m -u` leaves .git/index.lock: the next apply names it in one
    line and changes nothing (a running git's lock looks the same: never removed by the tool)."""
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    env = wrapped_env(tmp_path, "read-tree -m -u")
    proc = start(project, "apply", co, env=env)
    wait_reached(env, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    lock = co / ".git" / "index.lock"
    lock.write_text("")  # what git leaves when killed while writing the index
    before = snapshot(co)
    for verb in ("apply", "unapply"):
        r = run_module(project, verb, co)
        assert r.rc == 1, r.out + r.err
        assert len(r.err.strip().splitlines()) == 1, r.err
        assert "a git process" in r.err and f"remove {lock}" in r.err, r.err
        assert lock.exists() and snapshot(co) == before
    lock.unlink()
    r = run_module(project, "apply", co)
    assert r.rc == 0, r.err
    assert count(co) == 3 and git(co, "status", "--porcelain").strip() == ""
    assert not state_dir(co).exists()


def test_apply_after_a_kill_while_writing_the_journal(world, project, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    state = state_dir(co)
    state.mkdir()
    (state / "apply.json").write_text('{"orig": "12')  # cut short
    (state / "index").write_text("scratch")
    r = run_module(project, "apply", co)
    assert r.rc == 0, r.err
    assert count(co) == 3 and not state.exists()


@pytest.mark.skipif(
    importlib.util.find_spec("pip") is not None or shutil.which("pip") is None,
    reason="needs the pip on PATH (this interpreter has its own)",
)
def test_download_killed_leaves_nothing_the_next_run_keeps(world, tmp_path):
    cache, links = tmp_path / "cache", tmp_path / "links"
    links.mkdir()
    shutil.copy(world.cache / "megatron_core-0.1.0.tar.gz", links)
    project = world.project(tmp_path / "proj", prebuilt=False)
    bin_dir = tmp_path / "pipbin"
    bin_dir.mkdir()
    (bin_dir / "pip").write_text(WRAPPER.replace("REAL_GIT", "REAL_PIP"))
    (bin_dir / "pip").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "REAL_PIP": shutil.which("pip"),
        "STOP_AT": "download",
        "STOP_FOR": "30",
        "REACHED": str(tmp_path / "reached"),
        "MCORE_FIXES_CACHE": str(cache),
        "PIP_FIND_LINKS": str(links),
    }
    proc = start(project, "vendor", env=env)
    wait_reached(env, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert [p.name[:10] for p in cache.iterdir()] == [".download-"]
    r = run_module(project, "vendor", env={**env, "STOP_AT": "no-such-command"})
    assert r.rc == 0, r.err
    assert sorted(p.name for p in cache.iterdir()) == ["sha256"]


@pytest.mark.parametrize("rerun", ["unapply", "apply"])
@pytest.mark.parametrize("stop_at", ["read-tree -m -u", "update-ref"])
def test_unapply_killed_is_completed_or_undone_by_the_next_run(
    world, project, tmp_path, stop_at, rerun
):
    """Killed between moving the index and moving HEAD (SIGKILL, OOM, power): the files are
    back, HEAD not yet. The next `unapply` or `apply` finishes the undo from its journal: no
    staged change is left that the user never made."""
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    base = git(co, "rev-parse", "HEAD").strip()
    assert run_module(project, "apply", co).rc == 0
    (co / "README.md").write_text("my edit, not staged\n")
    env = wrapped_env(tmp_path, stop_at)
    proc = start(project, "unapply", co, env=env)
    wait_reached(env, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert count(co) == 3  # HEAD not moved yet
    r = run_module(project, rerun, co)
    assert r.rc == 0, r.err
    assert not state_dir(co).exists()
    assert git(co, "status", "--porcelain", "--untracked-files=all") == " M README.md\n"
    if rerun == "unapply":
        assert git(co, "rev-parse", "HEAD").strip() == base
        assert "HEAD back at" in r.out or "an interrupted unapply was completed" in r.out
    else:  # the undo finished (or found undone), then the series applied again
        assert count(co) == 3
    if stop_at == "update-ref":
        assert "an interrupted unapply was completed" in r.out, r.out
    else:
        assert "an interrupted unapply was undone" in r.out, r.out


@pytest.mark.parametrize("rerun", [("unapply",), ("apply", "--no-commit")])
def test_unapply_of_a_staged_series_killed_is_undone_by_the_next_run(
    world, project, tmp_path, rerun
):
    """`apply --no-commit`, then `unapply` killed as git is about to move the files back: the
    next `unapply` puts back what the killed one may have half written and undoes the staged
    series; the next `apply --no-commit` finds it staged, as it was. The user's edit stays
    either way."""
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    (co / "README.md").write_text("my edit, not staged\n")
    clean = git(co, "status", "--porcelain", "--untracked-files=all")
    assert run_module(project, "apply", "--no-commit", co).rc == 0
    staged = snapshot(co)
    env = wrapped_env(tmp_path, "read-tree -m -u")
    proc = start(project, "unapply", co, env=env)
    wait_reached(env, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    r = run_module(project, *rerun, co)
    assert r.rc == 0, r.err
    assert "an interrupted unapply of a staged series was undone" in r.out, r.out
    assert not state_dir(co).exists() and count(co) == 0
    if rerun == ("unapply",):
        assert git(co, "status", "--porcelain", "--untracked-files=all") == clean
    else:
        assert snapshot(co) == staged and "already applied (staged, not committed)" in r.out
