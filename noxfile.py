"""nox sessions: the series proven on every MCore baseline of patches/manifest.toml.

    nox -l                      the sessions; `prove(<baseline>)` and `tests(<baseline>)` per
                                baseline (not run by default)
    nox                         what CI runs: tool, lint, proofs (every baseline in one venv and
                                one tool process; git baselines skip without a checkout), audit
    MCORE_REPO=~/Megatron-LM nox -s "prove(main)"
    nox -s prove                every prove(<baseline>) session, one after the other (each says
                                which of them it is)

Environments use uv. torch is always installed first, pinned (MCORE_FIXES_TORCH, default
torch==2.13.0), from a local CPU wheel folder when PIP_FIND_LINKS / UV_FIND_LINKS names one,
so no install ever pulls a CUDA build of torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from mcore_fixes import manifest as manifest_mod  # noqa: E402
from mcore_fixes import sources  # noqa: E402
from mcore_fixes.maint import lint  # noqa: E402

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = False

MANIFEST = manifest_mod.load(ROOT / "patches" / "manifest.toml")
BASELINES = list(MANIFEST.baselines)
TORCH = os.environ.get("MCORE_FIXES_TORCH", "torch==2.13.0")
# MCore imports these on CPU; 0.18.2+ import triton unguarded (MoE paged stash).
TEST_DEPS = ("numpy", "packaging", "pytest", "einops")
# Upstream main's pins of its lint tools (mcore_fixes/maint/lint.py), and the griffe we measured
# with.
UPSTREAM_BLACK = tuple(f"{n}=={lint.DEFAULT_PINS[n]}" for n in ("black", "isort"))
UPSTREAM_LINT = (
    *UPSTREAM_BLACK,
    f"pylint=={lint.DEFAULT_PINS['pylint']}",
    f"griffe=={lint.GRIFFE}",
)

if "PIP_FIND_LINKS" in os.environ:
    os.environ.setdefault("UV_FIND_LINKS", os.environ["PIP_FIND_LINKS"])
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")


def _install_torch_env(session: nox.Session) -> None:
    # triton: 0.18.2+ import it unguarded; psutil: the proofs' forked worlds.
    session.install(TORCH, *TEST_DEPS, "triton", "psutil")


def _checkout_or_skip(session: nox.Session, baseline: str) -> None:
    b = MANIFEST.baselines[baseline]
    if (
        b.is_git
        and not os.environ.get("MCORE_REPO")
        and not sources.cached(b, ROOT / "build/trees")
    ):
        session.skip(
            f"{baseline} comes from a Megatron-LM git checkout: set MCORE_REPO=/path/to/Megatron-LM"
        )


@nox.session(tags=["ci"])
def tool(session: nox.Session) -> None:
    """The tool's own tests: synthetic upstream repo, offline."""
    # setuptools, pybind11: setup.py; pytest-xdist: the ~160 small git/subprocess tests spread
    # over every core (each test has its own tmp repos); pylint, griffe: lint-patches end to end
    session.install("pytest", "pytest-xdist", *UPSTREAM_LINT, "setuptools>=64,<80", "pybind11")
    workers = os.environ.get("MCORE_FIXES_JOBS", str(os.cpu_count() or 1))
    session.run("python", "-m", "pytest", "-q", "-n", workers, "tests/tool", *session.posargs)


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    """Our code with ruff; the patched files with upstream's black/isort settings."""
    session.install("ruff", *UPSTREAM_BLACK)
    ours = (
        "mcore_fixes",
        "tests/tool",
        "tests/proofs",
        "tests/multigpu",
        "tests/audit",
        "noxfile.py",
        "setup.py",
        "bench",
    )
    session.run("ruff", "check", *ours)
    session.run("ruff", "format", "--check", *ours)
    session.run("python", "-m", "mcore_fixes", "lint-patches")


@nox.session(tags=["ci"])
def proofs(session: nox.Session) -> None:
    """Every patch proven on every baseline (one venv; --jobs baselines at once)."""
    _install_torch_env(session)
    jobs = os.environ.get("MCORE_FIXES_JOBS", str(os.cpu_count() or 1))
    os.environ.setdefault("MCORE_FIXES_PROOF_TIMEOUT", "300")  # a hung world fails, not CI
    timing = ROOT / "build" / "ci-proofs.json"
    args = ("--jobs", jobs, "--timing", str(timing), *session.posargs)
    session.run("python", "-m", "mcore_fixes", "prove", *args)


@nox.session(tags=["ci"])
def audit(session: nox.Session) -> None:
    """`audit` on checkpoints that pristine baselines and the fork write (gloo, CPU)."""
    _install_torch_env(session)
    session.run(
        "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/audit", *session.posargs
    )


@nox.session(default=False)
@nox.parametrize("baseline", BASELINES, ids=BASELINES)
def prove(session: nox.Session, baseline: str) -> None:
    """Fail-before / pass-after of every patch on this baseline (`-s prove`: all, one by one)."""
    session.log(
        f"baseline {baseline}: {BASELINES.index(baseline) + 1} of {len(BASELINES)} prove "
        f'sessions (`nox -s prove` runs them all; one: `nox -s "prove({baseline})"`; '
        "every PyPI baseline in one session: `nox -s proofs`)"
    )
    _checkout_or_skip(session, baseline)
    _install_torch_env(session)
    session.run("python", "-m", "mcore_fixes", "prove", "--baseline", baseline, *session.posargs)


@nox.session(default=False)
@nox.parametrize("baseline", BASELINES, ids=BASELINES)
def tests(session: nox.Session, baseline: str) -> None:
    """The tests the patches carry (upstream's layer, CUDA), on the patched baseline.

    Most skip without a GPU; not in CI (the CPU proofs run in `proofs`).
    """
    _checkout_or_skip(session, baseline)
    _install_torch_env(session)
    session.run("python", "-m", "mcore_fixes", "test", "--baseline", baseline, *session.posargs)


@nox.session(default=False)
def status(session: nox.Session) -> None:
    """Print the patch x baseline matrix with the stored proofs (Markdown with -- --markdown)."""
    session.run("python", "-m", "mcore_fixes", "status", *session.posargs, external=True)
