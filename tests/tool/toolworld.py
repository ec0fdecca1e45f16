"""The synthetic world of the mcore_fixes tool tests: a fake Megatron-LM upstream, a toy series.

Everything is offline and built once per session (``build_world``, the ``world`` fixture):

* ``upstream``: a git repository shaped like Megatron-LM (``megatron/core/package_info.py``,
  two small modules, ``tests/unit_tests/``) with tags core_v0.1.0 .. core_v0.3.0;
* a toy series of three real ``git format-patch`` files made in a scratch clone at core_v0.1.0;
* a hand-made sdist ``megatron_core-0.1.0.tar.gz`` in a private ``MCORE_FIXES_CACHE``;
* a project template (``patches/`` + ``manifest.toml``) that each test copies.

Upstream history and what the series sees on each baseline:

=========== ============== ========== ========= =========
baseline    source         fix-mean   join-sep  weak-test
=========== ============== ========== ========= =========
0.1.0       pypi (cache)   applies    applies   applies
core_v0.1.1 git (rc0 tag)  applies    applies   absent
core_v0.2.0 git            upstream   applies   applies
core_v0.3.0 git            upstream   conflict  applies
=========== ============== ========== ========= =========

weak-test's regression test passes unpatched: `prove` must flag it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MAIN = Path(__file__).resolve().parents[2]  # the mcore-fixes clone (holds mcore_fixes/)
if str(MAIN) not in sys.path:
    sys.path.insert(0, str(MAIN))

from mcore_fixes import cli  # noqa: E402

FORMAT_PATCH = [
    "format-patch",
    "-1",
    "--zero-commit",
    "--no-signature",
    "-N",
    "--abbrev=12",
    "--stdout",
]

UPSTREAM_ID = {
    "GIT_AUTHOR_NAME": "Upstream Dev",
    "GIT_AUTHOR_EMAIL": "dev@upstream.example",
    "GIT_COMMITTER_NAME": "Upstream Dev",
    "GIT_COMMITTER_EMAIL": "dev@upstream.example",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+00:00",
}

AUTHORS = {
    "fix-mean": ("Ada Lovelace", "ada@example.com", "2024-02-03T04:05:06+01:00"),
    "join-sep": ("Grace Hopper", "grace@example.com", "2024-03-04T05:06:07-05:00"),
    "weak-test": ("Alan Turing", "alan@example.com", "2024-04-05T06:07:08+00:00"),
}
SUBJECTS = {
    "fix-mean": "Fix off-by-one in mean()",
    "join-sep": "Let join_names() take a separator",
    "weak-test": "Add constants module",
}
PATCH_FILES = {
    "fix-mean": "0001-fix-mean.patch",
    "join-sep": "0002-join-sep.patch",
    "weak-test": "0003-weak-test.patch",
}
# Our CPU proofs (manifest key `proof`), in the project's tests/proofs/; weak-test has none, so
# prove falls back to the test file its patch carries.
PROOF_FILES = {
    "fix-mean": "tests/proofs/test_fix_mean.py",
    "join-sep": "tests/proofs/test_join_sep.py",
}
PROOFS = {
    "fix-mean": """from megatron.core.calc import mean


def test_mean_of_three():
    assert mean([1, 2, 3]) == 2
""",
    "join-sep": """from megatron.core.util import join_names


def test_join_with_separator():
    assert join_names(["a", "b"], sep="-") == "a-b"


def test_default_separator_unchanged():  # compatibility: passes with and without the patch
    assert join_names(["a", "b"]) == "a,b"
""",
}
TEST_FILES = {
    "fix-mean": "tests/unit_tests/test_mean.py",
    "join-sep": "tests/unit_tests/test_join.py",
    "weak-test": "tests/unit_tests/test_constants.py",
}


def package_info(major: int, minor: int, patch: int, pre: str = "") -> str:
    return (
        f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = '{pre}'\n\n"
        "# Use the following formatting: (major, minor, patch, pre-release)\n"
        "VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)\n\n"
        "__version__ = '.'.join(map(str, VERSION[:3])) + ''.join(VERSION[3:])\n"
    )


CALC_BUGGY = '''"""Tiny arithmetic helpers."""


def mean(values):
    """Arithmetic mean of a non-empty sequence."""
    total = sum(values)
    return total / (len(values) - 1)


def double(x):
    return 2 * x
'''
CALC_FIXED = CALC_BUGGY.replace("(len(values) - 1)", "len(values)")

UTIL = '''"""String helpers."""


def join_names(names):
    """Join names with commas."""
    return ",".join(names)


def upper(name):
    return name.upper()
'''
UTIL_SEP = UTIL.replace("def join_names(names):", 'def join_names(names, sep=","):').replace(
    'return ",".join(names)', "return sep.join(names)"
)
UTIL_V3 = '''"""String helpers (rewritten in 0.3.0)."""


def join_names(names, *, strict=False):
    """Join names with a comma and a space."""
    return ", ".join(str(n) for n in names)


def upper(name):
    return name.upper()
'''

# The sdist must be downloadable by `pip download` offline (--no-index --find-links): pip
# prepares its metadata, so it carries an in-tree PEP 517 backend that needs nothing.
PYPROJECT = """[build-system]
requires = []
build-backend = "fake_backend"
backend-path = ["."]

[project]
name = "megatron-core"
dynamic = ["version"]
dependencies = ["torch", "numpy"]
"""
FAKE_BACKEND = '''"""A PEP 517 backend that only prepares metadata (enough for `pip download`)."""
import os
import re


def _version():
    with open(os.path.join("megatron", "core", "package_info.py")) as f:
        fields = dict(re.findall(r"^(MAJOR|MINOR|PATCH) = (\\d+)$", f.read(), re.M))
    return "{MAJOR}.{MINOR}.{PATCH}".format(**fields)


def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    name = f"megatron_core-{_version()}.dist-info"
    os.makedirs(os.path.join(metadata_directory, name))
    with open(os.path.join(metadata_directory, name, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\\nName: megatron-core\\nVersion: {_version()}\\n")
    return name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise RuntimeError("this fake sdist is for download tests only")
'''

TEST_MEAN = """from megatron.core.calc import mean


def test_mean_of_three():
    assert mean([1, 2, 3]) == 2
"""
TEST_JOIN = """from megatron.core.util import join_names


def test_join_with_separator():
    assert join_names(["a", "b"], sep="-") == "a-b"
"""
TEST_CONSTANTS = """def test_trivial():
    # A regression test that cannot fail: prove must flag it.
    assert 1 + 1 == 2
"""


def git(cwd: Path, *args: str, env: dict[str, str] | None = None, check: bool = True) -> str:
    proc = subprocess.run(
        ["git", "-C", str(cwd), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed in {cwd}:\n{proc.stderr}")
    return proc.stdout


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def commit_all(repo: Path, message: str, env: dict[str, str] | None = None) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message, env=env or UPSTREAM_ID)
    return git(repo, "rev-parse", "HEAD").strip()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


@dataclass
class World:
    base: Path
    upstream: Path
    commits: dict[str, str]  # tag -> commit
    patches: Path  # patches/ of the template project
    cache: Path
    sdist_sha: str
    template: Path  # project root with patches/ and a pre-built build/trees

    def clone(self, dest: Path, tag: str, branch: str = "work") -> Path:
        git(self.base, "clone", "-q", str(self.upstream), str(dest))
        git(dest, "checkout", "-q", "-b", branch, tag)
        return dest

    def project(self, dest: Path, prebuilt: bool = True) -> Path:
        """A fresh copy of the template project (with pristine trees, unless prebuilt=False)."""
        shutil.copytree(
            self.template,
            dest,
            symlinks=True,
            ignore=None if prebuilt else shutil.ignore_patterns("build"),
        )
        return dest


def manifest_text(commits: dict[str, str], sdist_sha: str) -> str:
    return f'''# toy series for the tool tests
canonical = "0.1.0"
default = "0.1.0"

[[patch]]
id = "fix-mean"
file = "{PATCH_FILES["fix-mean"]}"
fix = 1
proof = "{PROOF_FILES["fix-mean"]}"

[[patch]]
id = "join-sep"
file = "{PATCH_FILES["join-sep"]}"
fix = 2
requires = ["fix-mean"]
proof = "{PROOF_FILES["join-sep"]}"

[[patch]]
id = "weak-test"
file = "{PATCH_FILES["weak-test"]}"
fix = 3

[baselines."0.1.0"]
source = "pypi"
version = "0.1.0"
sha256 = "{sdist_sha}"

[baselines."core_v0.1.1"]
source = "git"
ref = "core_v0.1.1"
commit = "{commits["core_v0.1.1"]}"
# package_info.py at this tag says 0.1.1rc0: only the pinned commit identifies it
version = "0.1.1"
absent = {{ weak-test = "constants.py does not exist in 0.1.1" }}

[baselines."core_v0.2.0"]
source = "git"
ref = "core_v0.2.0"
commit = "{commits["core_v0.2.0"]}"
version = "0.2.0"

[baselines."core_v0.3.0"]
source = "git"
ref = "core_v0.3.0"
commit = "{commits["core_v0.3.0"]}"
version = "0.3.0"
'''


def run_module(
    root: Path, *args: str, env: dict[str, str] | None = None, cwd: Path = MAIN
) -> Result:
    """`python -m mcore_fixes --root root args...` in a subprocess."""
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_fixes", "--root", str(root), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env if env is not None else None,
        timeout=120,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def snapshot(repo: Path) -> dict[str, str]:
    """HEAD, index and work tree of a checkout, to show that nothing changed."""
    files = {}
    for path in sorted(repo.rglob("*")):
        if ".git" in path.relative_to(repo).parts or not path.is_file():
            continue
        files[path.relative_to(repo).as_posix()] = sha256(path)
    return {
        "head": git(repo, "rev-parse", "HEAD"),
        "branch": git(repo, "symbolic-ref", "-q", "HEAD", check=False),
        "index": git(repo, "ls-files", "-s"),
        "status": git(repo, "status", "--porcelain", "--untracked-files=all"),
        "files": repr(files),
        "log": git(repo, "log", "--format=%H", "-n", "20"),
    }


def tree_snapshot(root: Path) -> dict[str, str]:
    """Every file under root (path -> sha256)."""
    return {
        p.relative_to(root).as_posix(): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()
    }


def upstream_branch(
    world: World, tmp: Path, tag: str, files: dict[str, str], branch: str
) -> tuple[Path, str]:
    """A private copy of the upstream (bare) with one more commit at `tag` writing `files`,
    on `branch`; returns (its git dir, the commit)."""
    up = tmp / "up" / ".git"
    git(world.base, "clone", "-q", "--bare", str(world.upstream), str(up))
    work = tmp / "upwork"
    git(world.base, "clone", "-q", str(up), str(work))
    git(work, "checkout", "-q", tag)
    for rel, text in files.items():
        write(work, rel, text)
    commit = commit_all(work, f"Upstream change on {branch}")
    git(work, "push", "-q", "origin", f"{commit}:refs/heads/{branch}")
    return up, commit


TORCHRUN = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("--"):
    args.pop(0)
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
sys.exit(subprocess.call([sys.executable, *args]))
"""


def fake_torchrun(tmp_path: Path) -> str:
    """A `python` whose folder has a stand-in `torchrun` (rank 0 of one, then the command)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    torchrun = bin_dir / "torchrun"
    torchrun.write_text(TORCHRUN.format(python=sys.executable))
    for f in (python, torchrun):
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return str(python)


def add_git_baseline(
    project: Path, name: str, commit: str, version: str, extra: str = "", **tables: dict[str, str]
) -> None:
    """Append git baseline `name` (ref = its name) to the project's manifest.

    `extra`: more keys of the baseline's table (TOML lines); `tables`: its sub-tables by name
    (``fixed_upstream={"join-sep": "abc"}`` writes ``[baselines.<name>.fixed-upstream]``).
    """
    text = f'\n[baselines.{name}]\nsource = "git"\nref = "{name}"\ncommit = "{commit}"\n'
    text += f'version = "{version}"\n{extra}'
    for table, keys in tables.items():
        if keys:
            text += f"[baselines.{name}.{table.replace('_', '-')}]\n"
            text += "".join(f'{k} = "{v}"\n' for k, v in keys.items())
    with (project / "patches/manifest.toml").open("a") as f:
        f.write(text)


def build_world(base: Path) -> World:
    """Build the synthetic upstream, the toy series, the cached sdist and the template."""
    up = base / "upstream"
    up.mkdir()
    git(up, "init", "-q", "-b", "main")
    commits: dict[str, str] = {}

    # core_v0.1.0
    write(up, "README.md", "Fake Megatron-LM\n")
    write(up, "pyproject.toml", PYPROJECT)
    write(up, "fake_backend.py", FAKE_BACKEND)
    write(up, "megatron/core/__init__.py", '"""Fake Megatron-Core."""\n')
    write(up, "megatron/core/package_info.py", package_info(0, 1, 0))
    write(up, "megatron/core/calc.py", CALC_BUGGY)
    write(up, "megatron/core/util.py", UTIL)
    write(up, "tests/unit_tests/__init__.py", "")
    write(up, "tests/unit_tests/test_basic.py", "def test_basic():\n    pass\n")
    commits["core_v0.1.0"] = commit_all(up, "Release 0.1.0")
    git(up, "tag", "core_v0.1.0")

    # The series, made in a scratch clone at core_v0.1.0.
    scratch = base / "scratch"
    git(base, "clone", "-q", str(up), str(scratch))
    patches = base / "template" / "patches"
    patches.mkdir(parents=True)
    changes = {
        "fix-mean": {"megatron/core/calc.py": CALC_FIXED, TEST_FILES["fix-mean"]: TEST_MEAN},
        "join-sep": {"megatron/core/util.py": UTIL_SEP, TEST_FILES["join-sep"]: TEST_JOIN},
        "weak-test": {
            "megatron/core/constants.py": "ANSWER = 42\n",
            TEST_FILES["weak-test"]: TEST_CONSTANTS,
        },
    }
    for pid, files in changes.items():
        name, email, date = AUTHORS[pid]
        env = {
            **UPSTREAM_ID,
            "GIT_AUTHOR_NAME": name,
            "GIT_AUTHOR_EMAIL": email,
            "GIT_AUTHOR_DATE": date,
        }
        for rel, text in files.items():
            write(scratch, rel, text)
        message = (
            f"{SUBJECTS[pid]}\n\nWhy {pid} is needed, in a paragraph.\n\n"
            f"Bug: https://example.com/issues/{pid}\nForwarded: no\n"
            f"Signed-off-by: {name} <{email}>\n"
        )
        commit_all(scratch, message, env=env)
        (patches / PATCH_FILES[pid]).write_text(git(scratch, *FORMAT_PATCH))

    # core_v0.1.1: a pre-release marker in package_info.py, an unrelated change.
    write(up, "megatron/core/package_info.py", package_info(0, 1, 1, "rc0"))
    write(up, "README.md", "Fake Megatron-LM, now with more words\n")
    commits["core_v0.1.1"] = commit_all(up, "Release 0.1.1")
    git(up, "tag", "core_v0.1.1")

    # core_v0.2.0: fix-mean merged upstream as is.
    git(up, "am", "-q", str(patches / PATCH_FILES["fix-mean"]), env=UPSTREAM_ID)
    write(up, "megatron/core/package_info.py", package_info(0, 2, 0))
    commits["core_v0.2.0"] = commit_all(up, "Release 0.2.0")
    git(up, "tag", "core_v0.2.0")

    # core_v0.3.0: util.py rewritten: join-sep conflicts.
    write(up, "megatron/core/util.py", UTIL_V3)
    write(up, "megatron/core/package_info.py", package_info(0, 3, 0))
    commits["core_v0.3.0"] = commit_all(up, "Release 0.3.0")
    git(up, "tag", "core_v0.3.0")

    # The PyPI sdist of 0.1.0, in the cache.
    cache = Path(os.environ["MCORE_FIXES_CACHE"])
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / "megatron_core-0.1.0.tar.gz"
    git(
        up,
        "archive",
        "--format=tar.gz",
        "--prefix=megatron_core-0.1.0/",
        "-o",
        str(sdist),
        "core_v0.1.0",
        "megatron",
        "pyproject.toml",
        "fake_backend.py",
        "README.md",
    )
    sdist_sha = sha256(sdist)

    (patches / "manifest.toml").write_text(manifest_text(commits, sdist_sha))
    template = patches.parent
    for pid, rel in PROOF_FILES.items():
        write(template, rel, PROOFS[pid])
    # Pre-build every pristine tree once; tests copy them with the project.
    with contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["--root", str(template), "status", "--mcore-repo", str(up)])
    assert rc == 0
    assert sorted(p.name for p in (template / "build" / "trees").glob("[!.]*")) == [
        "0.1.0",
        "core_v0.1.1",
        "core_v0.2.0",
        "core_v0.3.0",
    ]
    return World(base, up, commits, patches, cache, sdist_sha, template)
