"""A fork server for `prove`: one interpreter imports what every proof process imports before
megatron (torch and what `import megatron.core` pulls from it, pytest), then forks one process
per tree state, of the baselines it is handed one after the other.

A fresh interpreter spends ~4.5 s (2 CPUs) importing torch, torch._dynamo, torch._inductor,
sympy, ... before the first line of megatron; a fork of the server, none. Each fork becomes
what `python -c CODE ARGS` started in the tree would be: same cwd, environment, `sys.path`,
`sys.argv`, a fresh `random` seed, and the exit the code chooses. It imports
megatron from its tree only: the server never imports megatron nor any module of the tree
(checked after the preload and before every fork), so no tree state sees another's code.
Forks are made single-threaded (`threading.active_count() == 1`, checked; native idle pools
such as OpenBLAS's are fork-safe and are in every proof process that forks its ranks anyway).
Each fork leads its own process group: a timeout kills it with the ranks it forked.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

# What a proof process imports before megatron on every baseline: `import megatron.core` pulls
# all of these from torch on 0.13.1 .. 0.19.2 (sys.modules compared), and pytest runs it. Not
# more: a module megatron does not import stays out of the processes that prove it.
PRELOAD = (
    "numpy",
    "pytest",
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "einops",
    "packaging.version",
)

# `python -c SERVER FD MODULE...`: requests (one JSON line each) on stdin, replies on fd FD.
SERVER = r"""
import builtins, gc, importlib, json, os, sys, threading

FD = int(sys.argv[1])


def reply(**msg):
    os.write(FD, (json.dumps(msg) + "\n").encode())


def foreign(tree):
    here = tree.rstrip(os.sep) + os.sep
    for name, mod in list(sys.modules.items()):
        if name == "megatron" or name.startswith("megatron."):
            return f"imported {name}"
        if (getattr(mod, "__file__", None) or "").startswith(here):
            return f"imported {name} from the tree"
    if threading.active_count() != 1:
        return f"{threading.active_count()} threads"
    return ""


def become(req):
    os.setpgid(0, 0)
    os.close(FD)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.path[1:1] = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.dont_write_bytecode = bool(req["env"].get("PYTHONDONTWRITEBYTECODE"))
    importlib.invalidate_caches()
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = ["-c", *req["args"]]
    code = compile(req["code"], "<string>", "exec")
    exec(code, {"__name__": "__main__", "__builtins__": builtins})
    sys.exit(0)


for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except Exception:
        pass  # the fork imports it again and fails there, as a fresh interpreter would
why = foreign(os.getcwd())
gc.freeze()  # the preloaded heap: the forks' collections skip it
reply(ready=not why, why=why)
if why:
    sys.exit(0)
for line in sys.stdin:
    req = json.loads(line)
    why = foreign(req["cwd"])
    if why:
        reply(error=why)
        break
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        become(req)
    reply(pid=pid)
    _, status = os.waitpid(pid, 0)
    reply(rc=os.waitstatus_to_exitcode(status))
"""


class Gone(Exception):
    """The server cannot fork for us (it died, or refused): run a fresh interpreter instead."""


def enabled() -> bool:
    """Linux only (fork after importing torch); MCORE_FIXES_FORK_SERVER=0 turns it off."""
    return sys.platform.startswith("linux") and os.environ.get("MCORE_FIXES_FORK_SERVER") != "0"


class ForkServer:
    """One server process; `run` one request at a time, in any tree."""

    def __init__(self, python: str, cwd: Path, env: dict[str, str], timeout: float) -> None:
        env = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # the forks set theirs
        start = time.monotonic()
        read, write = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [python, "-c", SERVER, str(write), *PRELOAD],
                cwd=cwd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(write,),
            )
        except OSError:
            os.close(read)
            raise Gone("cannot start it") from None
        finally:
            os.close(write)
        self._fd, self._buf, self.alive = read, b"", True
        try:
            hello = self._read(timeout)
        except TimeoutError:
            hello = None
        self.seconds = time.monotonic() - start  # interpreter start + preload
        if not hello or not hello.get("ready"):
            self.close()
            raise Gone(hello.get("why", "") if hello else "it exited")

    def _read(self, timeout: float) -> dict | None:
        """The next reply; None at EOF; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                raise TimeoutError
            data = os.read(self._fd, 65536)
            if not data:
                return None
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(
        self, code: str, args: list[str], cwd: Path, env: dict[str, str], log: Path, timeout: float
    ) -> int | None:
        """Exit status of `python -c code *args` run as a fork in `cwd`; None: timed out."""
        req = {"code": code, "args": args, "cwd": str(cwd), "env": env, "log": str(log)}
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            started = self._read(60)
        except (OSError, TimeoutError):
            started = None
        if not started or "pid" not in started:
            self.close()
            raise Gone(started.get("error", "") if started else "it exited")
        pid = started["pid"]
        try:
            done = self._read(timeout)
        except TimeoutError:
            _kill_group(pid)
            try:  # the server reaps the killed fork and says so
                self._read(60)
            except TimeoutError:
                self.close()
            return None
        except BaseException:  # e.g. Ctrl-C: the fork and its ranks go with us
            _kill_group(pid)
            raise
        _kill_group(pid)  # what the fork left running (ranks) never outlives it
        if done is None:  # the server died under it: no verdict from this run
            self.close()
            raise Gone("it exited")
        return int(done["rc"])

    def close(self) -> None:
        self.alive = False
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def run_fresh(
    cmd: list[str], cwd: Path, env: dict[str, str], log: Path, timeout: float
) -> int | None:
    """Exit status of `cmd` in a fresh process group (None: timed out), like a fork's."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            _kill_group(proc.pid)  # on a timeout or Ctrl-C too: with what it forked
            proc.wait()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
