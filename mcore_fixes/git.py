"""Thin wrappers over the git command line; git does the heavy lifting."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from .errors import UserError

# Deterministic identity for commits the tool makes in its own work trees.
TOOL_IDENTITY = {
    "GIT_AUTHOR_NAME": "mcore-fixes",
    "GIT_AUTHOR_EMAIL": "mcore-fixes@users.noreply.github.com",
    "GIT_COMMITTER_NAME": "mcore-fixes",
    "GIT_COMMITTER_EMAIL": "mcore-fixes@users.noreply.github.com",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+00:00",
}

# The tool's own tree repositories (build/trees/*, marked by this file in their .git) run git
# without the user's global and system config: commit.gpgSign, core.autocrlf, diff.noprefix,
# format.signOff, hooks, ... must not change what the tool writes or make it fail.
TOOL_TREE_MARKER = "mcore-fixes-pin"
NEUTRAL_CONFIG = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}

# What the caller's environment may pass to git. Every other GIT_* variable is dropped: set by
# a hook (`git commit` exports GIT_INDEX_FILE to pre-commit) or a shell, GIT_DIR, GIT_WORK_TREE,
# GIT_INDEX_FILE, GIT_OBJECT_DIRECTORY, GIT_NAMESPACE, GIT_CONFIG_PARAMETERS/COUNT/KEY_n, ...
# would point the tool's resets, cleans and commits at other directories, indexes or configs.
# The user's checkout keeps the user's identity and choice of config files; the tool's own
# trees keep nothing.
USER_GIT_VARS = frozenset(
    {
        "GIT_AUTHOR_NAME",
        "GIT_AUTHOR_EMAIL",
        "GIT_COMMITTER_NAME",
        "GIT_COMMITTER_EMAIL",
        "GIT_CONFIG_GLOBAL",
        "GIT_CONFIG_SYSTEM",
        "GIT_CONFIG_NOSYSTEM",
    }
)

# `git format-patch` options of the series: reproducible byte for byte.
FORMAT_PATCH_ARGS = ("--zero-commit", "--no-signature", "-N", "--abbrev=12", "--stdout")


def git_exe() -> str:
    exe = shutil.which("git")
    if exe is None:
        raise UserError("git is not installed or not on PATH; mcore_fixes needs git >= 2.25")
    return exe


def is_tool_tree(repo: Path) -> bool:
    return (Path(repo) / ".git" / TOOL_TREE_MARKER).exists()


def environment(repo: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a git command on `repo`: the caller's, minus what redirects git."""
    tool_tree = is_tool_tree(repo)
    keep = frozenset() if tool_tree else USER_GIT_VARS
    base = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k in keep}
    neutral = NEUTRAL_CONFIG if tool_tree else {}
    return {**base, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C", **neutral, **(env or {})}


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT/SIGTERM/SIGHUP wait (for git's children too) until the block is done."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        while hasattr(signal, "sigtimedwait") and signal.sigtimedwait(held, 0):  # not on macOS
            pass  # the block is complete: drop them (elsewhere: delivered right after it)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def run(
    repo: Path,
    *args: str,
    check: bool = True,
    env: dict[str, str] | None = None,
    input: bytes | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `git -C repo args...`; raise UserError with git's own message on failure.

    With a scratch index (`GIT_INDEX_FILE` in `env`) no hook of the user runs: writing it is
    the tool's business, not a change of the user's index (`post-index-change`)."""
    scratch = ("-c", f"core.hooksPath={os.devnull}") if env and "GIT_INDEX_FILE" in env else ()
    proc = subprocess.run(
        [git_exe(), "-C", str(repo), *scratch, *args],
        capture_output=True,
        env=environment(repo, env),
        input=input.decode() if input is not None else None,
        text=True,
    )
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip()
        raise UserError(f"git {' '.join(args[:2])} failed in {repo}: {msg}")
    return proc


def out(repo: Path, *args: str, env: dict[str, str] | None = None) -> str:
    return run(repo, *args, env=env).stdout.strip()


def ok(repo: Path, *args: str, env: dict[str, str] | None = None) -> bool:
    return run(repo, *args, check=False, env=env).returncode == 0


def touched_paths(patch_text: str) -> list[str]:
    """Paths a patch touches (both sides of renames), from its `diff --git` headers."""
    paths: list[str] = []
    for line in patch_text.splitlines():
        if line.startswith("diff --git a/"):
            a, _, b = line[len("diff --git a/") :].partition(" b/")
            for p in (a, b):
                if p not in paths:
                    paths.append(p)
    return paths
