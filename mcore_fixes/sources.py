"""Pristine baseline trees: a pinned PyPI sdist or a pinned commit of a Megatron-LM checkout.

Each pristine tree is a small git repository (`build/trees/<baseline>`) whose first commit,
tagged `pristine`, holds the baseline's `megatron/core` (plus `tests/unit_tests` and
`pyproject.toml` where the source has them). Patched states are commits on top of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import io
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from . import git
from .errors import UserError
from .manifest import Baseline
from .progress import Progress

PIN_FILE = git.TOOL_TREE_MARKER  # inside the tree's .git directory
GIT_PATHS = ("megatron/core", "tests/unit_tests", "pyproject.toml")


def cache_dir() -> Path:
    env = os.environ.get("MCORE_FIXES_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mcore-fixes"


def mcore_repo_from(option: str | None) -> Path | None:
    """The Megatron-LM checkout given by --mcore-repo or MCORE_REPO, validated; None if unset."""
    value = option or os.environ.get("MCORE_REPO")
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.exists():
        raise UserError(f"Megatron-LM checkout {path} does not exist (--mcore-repo / MCORE_REPO)")
    if not git.ok(path, "rev-parse", "--git-dir"):
        raise UserError(f"{path} is not a git repository (--mcore-repo / MCORE_REPO)")
    return path


MAX_SDIST = 256 << 20  # bytes; MCore's sdists are a few MB


def read_regular(path: Path) -> bytes | None:
    """The bytes of the regular file at `path`, read through one descriptor (what is checked
    is what is used: the path is never opened again); None where it is not a regular file or
    is larger than MAX_SDIST. Opened non-blocking, so that a FIFO put there cannot hang us."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = f.read(MAX_SDIST + 1)
    return data if len(data) <= MAX_SDIST else None


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sdist_name(b: Baseline) -> str:
    return f"megatron_core-{b.version}.tar.gz"


# 0.17+ sdists declare Requires-Python >=3.12; the tool may run on 3.11 (it only reads them).
PIP_TARGET_PYTHON = "3.12"


def fetch_sdist(b: Baseline, progress: Progress) -> tuple[Path, bytes]:
    """The verified sdist of a PyPI baseline, from the cache or downloaded with pip: where it
    was found, and its bytes, read once and checked against the pin (the caller extracts these
    bytes, never the file again: the cache may be writable by others, MCORE_FIXES_CACHE).

    The cache is keyed by hash: `<cache>/sha256/<pin>/<name>`, plus `<cache>/<name>` where a
    user placed it by hand. A file whose hash is not the pin is ignored, never deleted or
    overwritten (another manifest may pin it). pip downloads in hash-checking mode, so it
    refuses other bytes before it prepares (runs the build code of) anything.
    """
    cache = cache_dir()
    target = cache / "sha256" / b.sha256 / sdist_name(b)
    ignored = ""
    for candidate in (target, cache / sdist_name(b)):
        data = read_regular(candidate) if candidate.is_file() else None
        if data is not None:
            actual = sha256_of(data)
            if actual == b.sha256:
                return candidate, data
            ignored = f"the cached {candidate} has sha256 {actual}, not the pin; left alone. "
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"the download cache {cache} is not a usable directory ({exc.strerror}); "
            "set MCORE_FIXES_CACHE to another one"
        ) from None
    progress.step(f"downloading megatron-core=={b.version} sdist with pip")
    for stale in cache.glob(".download-*"):  # of a killed run: nobody holds its lock
        with _dir_lock(stale, wait=False) as mine:
            if mine:
                shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp, _dir_lock(Path(tmp)):
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"megatron-core=={b.version} --hash=sha256:{b.sha256}\n")
        dest = Path(tmp) / "files"
        cmd = [*pip_command(), "download", "--no-deps", "--no-binary", ":all:", "-q"]
        cmd += ["--python-version", PIP_TARGET_PYTHON, "--require-hashes"]
        proc = subprocess.run(
            [*cmd, "-d", str(dest), "-r", str(requirements)],
            capture_output=True,
            text=True,
            env=pip_env(),
        )
        got = dest / sdist_name(b)
        data = read_regular(got) or b""
        output = proc.stderr + proc.stdout
        if "DO NOT MATCH THE HASHES" in output:
            m = re.search(r"Got\s+([0-9a-f]{64})", output)
            raise UserError(
                f"{ignored}sha256 mismatch for {sdist_name(b)}: the package index serves "
                f"{m.group(1) if m else 'other bytes'}, the manifest pins {b.sha256}; the "
                "download was discarded before anything in it ran"
            )
        if proc.returncode != 0 or sha256_of(data) != b.sha256:
            tail = output.strip().splitlines()[-3:]
            raise UserError(
                f"{ignored}could not download megatron-core=={b.version} from the package "
                f"index (is it reachable?): {' / '.join(tail)}. Offline, place {sdist_name(b)} "
                f"(sha256 {b.sha256}) in the cache {cache} (or set MCORE_FIXES_CACHE)."
            )
        verified = Path(tmp) / "verified"  # our own folder (mode 0700): the bytes checked
        verified.write_bytes(data)
        _store(verified, cache, ("sha256", b.sha256, sdist_name(b)))
    return target, data


def _store(src: Path, cache: Path, parts: tuple[str, ...]) -> None:
    """Move `src` to cache/parts..., never through a symlink (the cache may be writable by
    others); where one is in the way, the file is not cached (it was used all the same)."""
    try:
        fd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        for part in parts[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=fd)
            sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = sub
        os.replace(src, parts[-1], dst_dir_fd=fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def pip_env() -> dict[str, str]:
    """The environment for pip, minus what pip's isolated build env adds (`pip install .` runs
    setup.py there): its PYTHONPATH hides the interpreter's own site-packages, pip included."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}


def pip_command() -> list[str]:
    """pip of this interpreter, else the one on PATH."""
    probe = subprocess.run(
        [sys.executable, "-m", "pip", "--version"], capture_output=True, env=pip_env()
    )
    if probe.returncode == 0:
        return [sys.executable, "-m", "pip"]
    exe = shutil.which("pip") or shutil.which("pip3")
    if exe is None:
        raise UserError("pip is needed to download a PyPI baseline but was not found")
    return [exe]


MAX_MEMBERS = 100_000  # megatron/core + tests/unit_tests hold a few thousand files


def safe_extract(archive: tarfile.TarFile, dest: Path, strip: int, keep: tuple[str, ...]) -> int:
    """Extract members under the `keep` prefixes, after stripping `strip` leading components.

    Refuses (UserError, nothing extracted), before writing anything: absolute paths, `..`
    components, symlinks, hardlinks other than to an earlier regular member, device files and
    other special members, a name that occurs twice, more than MAX_MEMBERS members. A corrupt
    or truncated stream met while reading is a UserError too (the caller names the archive).
    """
    selected: list[tarfile.TarInfo] = []
    seen: dict[str, tarfile.TarInfo] = {}
    kept: dict[str, str] = {}  # archive name -> extracted name
    for count, member in enumerate(archive, 1):  # lazily: a huge index is refused early
        if count > MAX_MEMBERS:
            raise UserError(f"archive has more than {MAX_MEMBERS} members: not an MCore sdist")
        path = PurePosixPath(member.name)
        if path.is_absolute() or ".." in path.parts:
            raise UserError(f"unsafe archive entry {member.name!r}: escapes the target directory")
        name = path.as_posix()
        if name in seen and not (member.isdir() and seen[name].isdir()):
            raise UserError(f"archive entry {member.name!r} occurs twice")
        if member.issym():
            raise UserError(f"unsafe archive entry {member.name!r}: a symlink")
        if member.islnk():
            target = seen.get(PurePosixPath(member.linkname).as_posix())
            if target is None or not target.isfile():
                raise UserError(
                    f"unsafe archive entry {member.name!r}: hardlink to {member.linkname!r}, "
                    "which is not an earlier file of the archive"
                )
        elif not (member.isfile() or member.isdir()):
            raise UserError(f"unsafe archive entry {member.name!r}: not a file or directory")
        seen[name] = member
        parts = path.parts[strip:]
        if not parts:
            continue
        rel = "/".join(parts)
        if not any(rel == k or rel.startswith(k + "/") for k in keep):
            continue
        if member.islnk():  # to a member extracted too, by its extracted name
            target = kept.get(PurePosixPath(member.linkname).as_posix())
            if target is None:
                raise UserError(f"archive entry {member.name!r}: hardlink out of the tree")
            member.linkname = target
        kept[name] = rel
        member.name = rel
        selected.append(member)
    try:
        archive.extractall(dest, members=selected, filter="data")
    except (KeyError, tarfile.TarError, OSError) as exc:
        raise UserError(f"cannot extract the archive ({exc})") from None
    return len(selected)


def _materialize(b: Baseline, dest: Path, mcore_repo: Path | None, progress: Progress) -> str:
    """Write the baseline's files into `dest`; return the pin that identifies them."""
    if b.source == "pypi":
        sdist, data = fetch_sdist(b, progress)
        progress.step(f"extracting {sdist.name}")
        try:  # the bytes checked against the pin, not the file again
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
                safe_extract(tar, dest, strip=1, keep=("megatron/core", "pyproject.toml"))
        except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise UserError(f"{sdist} is not a readable .tar.gz archive ({exc})") from None
        except UserError as exc:
            raise UserError(f"{sdist}: {exc}") from None
        return b.sha256
    if mcore_repo is None:
        raise UserError(
            f"baseline {b.name} comes from a Megatron-LM git checkout: pass --mcore-repo PATH "
            "or set MCORE_REPO"
        )
    if not git.ok(mcore_repo, "cat-file", "-e", f"{b.commit}^{{commit}}"):
        raise UserError(
            f"commit {b.commit} ({b.ref}) is not in {mcore_repo}; run `git fetch --tags` there"
        )
    progress.step(f"reading {b.ref} ({b.commit[:10]}) from {mcore_repo}")
    present = [p for p in GIT_PATHS if git.ok(mcore_repo, "cat-file", "-e", f"{b.commit}:{p}")]
    archive = ["-c", "core.autocrlf=false", "archive", "--format=tar", b.commit, *present]
    proc = subprocess.run(
        [git.git_exe(), "-C", str(mcore_repo), *archive],
        capture_output=True,
        env=git.environment(mcore_repo),
    )
    if proc.returncode != 0:
        raise UserError(f"git archive failed in {mcore_repo}: {proc.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        safe_extract(tar, dest, strip=0, keep=GIT_PATHS)
    return b.commit


@contextlib.contextmanager
def _dir_lock(path: Path, wait: bool = True) -> Iterator[bool]:
    """An exclusive flock on a directory (no file created); yields whether it was taken. A
    symlink or anything but a directory (a FIFO would block the open) is never taken."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            taken = True
        except BlockingIOError:
            taken = False
        yield taken
    finally:
        os.close(fd)


@contextlib.contextmanager
def project_lock(root: Path, progress: Progress) -> Iterator[None]:
    """Serialize runs of the tool that reset and check out the tree repositories of `root`
    (or, for `apply`, that move a checkout: `root` is its git dir).

    The lock is taken on the directory itself, so it creates no file.
    """
    if not root.is_dir():
        raise UserError(f"project root {root} is not a directory")
    fd = os.open(root, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress.step(f"waiting for another mcore_fixes run in {root}", long=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def cached(b: Baseline, trees: Path) -> bool:
    """Whether the pristine tree of `b` is already materialized (usable without a checkout):
    its pin file names `b`'s pin and the git tree it was built with (from the verified
    source), and its `pristine` tag is still that tree. Else it is built again: a tree made
    by an earlier version of the tool (its pin file names no tree) or changed since is never
    vendored under the pin."""
    tree = trees / b.name
    try:
        recorded = (tree / ".git" / PIN_FILE).read_text().split()
    except OSError:
        return False
    if len(recorded) != 3 or recorded[:2] != [b.pin, "tree"]:
        return False
    found = git.run(tree, "rev-parse", "-q", "--verify", "pristine^{tree}", check=False)
    return found.returncode == 0 and found.stdout.strip() == recorded[2]


def pristine_tree(b: Baseline, trees: Path, mcore_repo: Path | None, progress: Progress) -> Path:
    """The baseline's pristine tree repository, built once and reused while its pin and its
    recorded git tree match (`cached`)."""
    tree = trees / b.name
    if cached(b, trees):
        return tree
    pin = b.pin
    trees.mkdir(parents=True, exist_ok=True)
    for stale in trees.glob(f".{b.name}.*"):  # left by a killed build (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{b.name}.", dir=trees))
    try:
        _materialize(b, tmp, mcore_repo, progress)
        git.run(tmp, "init", "-q", env=git.NEUTRAL_CONFIG)
        (tmp / ".git" / PIN_FILE).write_text(pin + "\n")  # from here on, a neutral git config
        git.run(tmp, "add", "-A")
        env = git.TOOL_IDENTITY
        git.run(tmp, "commit", "-q", "--no-verify", "-m", f"pristine {b.name}", env=env)
        git.run(tmp, "tag", "pristine")
        built = git.out(tmp, "rev-parse", "pristine^{tree}")
        (tmp / ".git" / PIN_FILE).write_text(f"{pin}\ntree {built}\n")
        if tree.exists():  # renamed away first: a kill never leaves half a tree with its pin
            os.replace(tree, trees / f".{b.name}.retired")
        os.replace(tmp, tree)
        shutil.rmtree(trees / f".{b.name}.retired", ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return tree
