"""Bad input: one clear line on stderr, a non-zero exit, and nothing changed."""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
from toolworld import git, run_module, sha256, snapshot, tree_snapshot, write

from mcore_fixes.errors import UserError
from mcore_fixes.sources import safe_extract

# The PyPI baselines are fetched with `pip download` (this interpreter's pip, or one on PATH).
HAVE_PIP = importlib.util.find_spec("pip") is not None or shutil.which("pip") is not None
needs_pip = pytest.mark.skipif(not HAVE_PIP, reason="no pip to download with")


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("mcore_fixes: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_unknown_baseline(project, tool, tmp_path, world):
    before = tree_snapshot(project)
    for verb in (["vendor"], ["status"], ["prove"]):
        r = tool(project, *verb, "--baseline", "0.9.9")
        assert r.rc == 2
        msg = one_line(r.err)
        assert "unknown baseline '0.9.9'" in msg
        assert "known baselines: 0.1.0, core_v0.1.1, core_v0.2.0, core_v0.3.0" in msg
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    co_before = snapshot(co)
    r = tool(project, "apply", "--baseline", "0.9.9", co)
    assert r.rc == 2 and "unknown baseline '0.9.9'" in one_line(r.err)
    assert snapshot(co) == co_before
    assert tree_snapshot(project) == before


def test_checkout_matching_no_baseline(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.3.0")
    info = co / "megatron/core/package_info.py"
    info.write_text(info.read_text().replace("MINOR = 3", "MINOR = 9"))
    git(co, "checkout", "-q", "--orphan", "flat")  # no pinned commit in its history
    git(co, "commit", "-qam", "bump")
    before = snapshot(co)
    r = tool(project, "apply", co)
    assert r.rc == 2
    msg = one_line(r.err)
    assert "megatron-core 0.9.0" in msg and "matches no baseline" in msg
    assert "Known releases (PyPI versions): 0.1.0" in msg and "--baseline NAME" in msg
    git_baselines = msg.split("Known git baselines (tags and branches): ")[1].split(". ")[0]
    assert "core_v0.3.0" in git_baselines and "(" not in git_baselines
    assert snapshot(co) == before


@pytest.fixture
def vendored(project, tool):
    assert tool(project, "vendor").rc == 0
    return project


def _corrupt(project: Path, how: str) -> Path:
    patch = project / "patches/0002-join-sep.patch"
    text = patch.read_text()
    if how == "truncated":
        patch.write_text(text[: text.index("+def join_names") + 10])
    elif how == "garbage":
        patch.write_text("this is not a patch\n")
    elif how == "binary":
        patch.write_bytes(b"\xff\xfe\x00garbage")
    elif how == "no-header":  # a bare `git diff`, not a format-patch file
        patch.write_text(text[text.index("diff --git") :])
    elif how == "bad-hunk":
        patch.write_text(text.replace("@@ -1,9 +1,9 @@", "@@ -1,9 +1,99 @@"))
    elif how == "cut-at-section":  # valid diff, but the test file's section is gone
        patch.write_text(text[: text.index("diff --git a/tests/unit_tests/test_join.py")])
    elif how == "symlink":
        patch.write_text(text + SYMLINK_SECTION)
    elif how == "tests-tool":  # would overwrite this repository's own tests when vendored
        patch.write_text(text.replace("tests/unit_tests/test_join.py", "tests/tool/conftest.py"))
    elif how == "directory":
        patch.unlink()
        patch.mkdir()
        return patch
    assert patch.read_bytes() != text.encode()
    return patch


SYMLINK_SECTION = """diff --git a/megatron/core/passwd b/megatron/core/passwd
new file mode 120000
index 000000000000..d2ac0bd2a3be
--- /dev/null
+++ b/megatron/core/passwd
@@ -0,0 +1 @@
+/etc/passwd
\\ No newline at end of file
"""


@pytest.mark.parametrize(
    "how,words",
    [
        ("truncated", "corrupt patch"),
        ("garbage", "corrupt patch: no `diff --git`"),
        ("binary", "not a text patch"),
        ("no-header", "not a `git format-patch` file"),
        ("bad-hunk", "corrupt patch"),
        ("cut-at-section", "truncated patch: its diffstat lists 2 files, it has 1"),
        ("symlink", "creates a symlink or submodule (mode 120000)"),
        ("tests-tool", "outside megatron/ and tests/unit_tests/: ['tests/tool/conftest.py']"),
        ("directory", "cannot read the patch file (Is a directory)"),
    ],
)
def test_corrupt_patch(vendored, tool, world, tmp_path, how, words):
    project = vendored
    patch = _corrupt(project, how)
    before = tree_snapshot(project / "megatron")
    for verb in (["vendor", "--force"], ["status"], ["prove", "--baseline", "0.1.0"]):
        r = tool(project, *verb)
        assert r.rc == 2, (verb, r.out, r.err)
        msg = one_line(r.err)
        assert str(patch) in msg and words in msg
    assert tree_snapshot(project / "megatron") == before
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    co_before = snapshot(co)
    r = tool(project, "apply", co)
    assert r.rc == 2 and words in one_line(r.err)
    assert snapshot(co) == co_before


PLAIN_SECTION = "--- a/setup.py\n+++ b/setup.py\n@@ -0,0 +1 @@\n+import os\n"


@pytest.mark.parametrize(
    "path", ["setup.py", "tests/../setup.py", "megatron_evil/x.py", "plain diff section"]
)
def test_patch_outside_megatron_and_tests(project, tool, world, tmp_path, path):
    patch = project / "patches/0002-join-sep.patch"
    if path == "plain diff section":  # a `---`/`+++` section without a `diff --git` header
        patch.write_text(patch.read_text() + PLAIN_SECTION)
        path = "setup.py"
    else:
        patch.write_text(patch.read_text().replace("tests/unit_tests/test_join.py", path))
    r = tool(project, "vendor")
    assert r.rc == 2
    msg = one_line(r.err)
    assert "outside megatron/ and tests/" in msg and path in msg
    assert not (project / "megatron").exists()
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    before = snapshot(co)
    r = tool(project, "apply", co)
    assert r.rc == 2 and "outside megatron/ and tests/" in one_line(r.err)
    assert snapshot(co) == before
    assert not (tmp_path / "setup.py").exists()


@needs_pip
def test_sha256_mismatch_in_cache_is_left_alone_then_offline_fails(
    world, tool, tmp_path, monkeypatch
):
    cache = tmp_path / "cache"
    cache.mkdir()
    bad = cache / "megatron_core-0.1.0.tar.gz"
    bad.write_bytes(b"not the pinned sdist")
    monkeypatch.setenv("MCORE_FIXES_CACHE", str(cache))
    project = world.project(tmp_path / "proj", prebuilt=False)
    r = tool(project, "vendor")
    assert r.rc == 2
    msg = one_line(r.err)
    assert "not the pin; left alone" in msg
    assert "could not download megatron-core==0.1.0" in msg
    assert f"place megatron_core-0.1.0.tar.gz (sha256 {world.sdist_sha}) in the cache" in msg
    assert "MCORE_FIXES_CACHE" in msg
    assert bad.read_bytes() == b"not the pinned sdist"  # another manifest may pin it
    assert not (project / "megatron").exists()
    assert tree_snapshot(cache) == {"megatron_core-0.1.0.tar.gz": sha256(bad)}  # no temp left


@needs_pip
def test_download_through_pip_and_sha256_check(world, tool, tmp_path, monkeypatch):
    """pip offline (--no-index --find-links): a good sdist is cached, a bad one discarded."""
    links, cache = tmp_path / "links", tmp_path / "cache"
    links.mkdir()
    sdist = world.cache / "megatron_core-0.1.0.tar.gz"
    monkeypatch.setenv("MCORE_FIXES_CACHE", str(cache))
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))

    # A tampered sdist on the "index": same name and version, other bytes.
    with tarfile.open(sdist) as src, tarfile.open(links / sdist.name, "w:gz") as dst:
        for m in src.getmembers():
            data = src.extractfile(m) if m.isfile() else None
            if m.name.endswith("calc.py"):
                payload = data.read() + b"# tampered\n"
                m.size = len(payload)
                data = io.BytesIO(payload)
            dst.addfile(m, data)
    project = world.project(tmp_path / "proj", prebuilt=False)
    r = tool(project, "vendor")
    assert r.rc == 2
    msg = one_line(r.err)
    assert "sha256 mismatch for megatron_core-0.1.0.tar.gz" in msg and "discarded" in msg
    assert sha256(links / sdist.name) in msg
    assert tree_snapshot(cache) == {} and not (project / "megatron").exists()

    shutil.copy(sdist, links / sdist.name)
    r = tool(project, "vendor")
    assert r.rc == 0, r.err
    assert (cache / "sha256" / world.sdist_sha / sdist.name).read_bytes() == sdist.read_bytes()
    assert (project / "megatron/core/calc.py").exists()


def _tar(*members: tuple[str, str, str | bytes]) -> tarfile.TarFile:
    """A tarfile from (kind, name, data-or-linkname) triples."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for kind, name, value in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                payload = value.encode() if isinstance(value, str) else value
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
                continue
            info.type = {
                "sym": tarfile.SYMTYPE,
                "hard": tarfile.LNKTYPE,
                "dir": tarfile.DIRTYPE,
                "fifo": tarfile.FIFOTYPE,
                "chr": tarfile.CHRTYPE,
            }[kind]
            info.linkname = value
            tar.addfile(info)
    buf.seek(0)
    return tarfile.open(fileobj=buf)


GOOD = ("file", "pkg-1/megatron/core/ok.py", "x = 1\n")
SETUP = ("file", "pkg-1/setup.py", "no\n")  # outside what is kept


@pytest.mark.parametrize(
    "evil,words",
    [
        (("file", "pkg-1/megatron/core/../../../escaped.py", "x"), "escapes the target"),
        (("file", "../escaped.py", "x"), "escapes the target"),
        (("file", "/tmp/escaped-absolute.py", "x"), "escapes the target"),
        (("sym", "pkg-1/megatron/core/link", "/etc/passwd"), "a symlink"),
        (("sym", "pkg-1/megatron/core/link", "../../../../outside"), "a symlink"),
        (("sym", "pkg-1/megatron/core/link", "ok.py"), "a symlink"),  # none in MCore's trees
        (("hard", "pkg-1/megatron/core/hard", "../outside"), "hardlink to '../outside'"),
        (("hard", "pkg-1/megatron/core/hard", "/etc/passwd"), "hardlink to '/etc/passwd'"),
        (("hard", "pkg-1/megatron/core/hard", "pkg-1/missing.py"), "not an earlier file"),
        (("hard", "pkg-1/megatron/core/hard", "pkg-1/setup.py"), "hardlink out of the tree"),
        (("file", "pkg-1/megatron/core/ok.py", "y = 2\n"), "occurs twice"),
        (("fifo", "pkg-1/megatron/core/fifo", ""), "not a file or directory"),
        (("chr", "pkg-1/megatron/core/dev", ""), "not a file or directory"),
    ],
)
def test_safe_extract_refuses_escapes(tmp_path, evil, words):
    dest = tmp_path / "dest"
    dest.mkdir()
    # The evil member comes last: nothing at all may have been written.
    with _tar(GOOD, SETUP, evil) as tar, pytest.raises(UserError, match=words):
        safe_extract(tar, dest, strip=1, keep=("megatron/core",))
    assert list(dest.iterdir()) == []
    assert not (tmp_path / "escaped.py").exists()
    assert not Path("/tmp/escaped-absolute.py").exists()


def test_safe_extract_keeps_only_selected_paths(tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    members = [
        GOOD,
        ("dir", "pkg-1/megatron/core/sub", ""),
        ("file", "pkg-1/megatron/core/sub/a.py", "a\n"),
        ("hard", "pkg-1/megatron/core/sub/alias.py", "pkg-1/megatron/core/sub/a.py"),
        ("file", "pkg-1/megatron/training/t.py", "no\n"),
        ("file", "pkg-1/pyproject.toml", "[project]\n"),
        ("file", "pkg-1/setup.py", "no\n"),
    ]
    with _tar(*members) as tar:
        n = safe_extract(tar, dest, strip=1, keep=("megatron/core", "pyproject.toml"))
    assert n == 5
    got = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*"))
    assert got == [
        "megatron",
        "megatron/core",
        "megatron/core/ok.py",
        "megatron/core/sub",
        "megatron/core/sub/a.py",
        "megatron/core/sub/alias.py",
        "pyproject.toml",
    ]
    assert (dest / "megatron/core/sub/alias.py").read_text() == "a\n"


def test_git_missing(world, project, tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "PATH": str(empty)}
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    co_before = snapshot(co)
    before = tree_snapshot(project)
    for args in (
        ["vendor"],
        ["status"],
        ["export"],
        ["apply", str(co)],
        ["prove", "--python", sys.executable],
    ):
        r = run_module(project, *args, env=env)
        assert r.rc == 2, (args, r.out, r.err)
        assert "git is not installed or not on PATH" in one_line(r.err)
    assert tree_snapshot(project) == before
    assert snapshot(co) == co_before


MANIFEST_ERRORS = {
    "toml": ("canonical = \n", "invalid TOML"),
    "no-sha": (
        '[baselines."0.1.0"]\nsource = "pypi"\nversion = "0.1.0"\n',
        "pypi source needs a sha256 pin",
    ),
    "short-commit": (
        '[baselines.x]\nsource = "git"\nversion = "1"\ncommit = "abc"\n',
        "git source needs a full 40-hex commit",
    ),
    "source": ('[baselines.x]\nsource = "conda"\nversion = "1"\n', "source must be"),
    "no-version": ('[baselines.x]\nsource = "git"\ncommit = "' + "a" * 40 + '"\n', "baseline x"),
    "later-require": (
        '[[patch]]\nid = "a"\nfile = "a.patch"\nfix = 1\nrequires = ["b"]\n'
        '[[patch]]\nid = "b"\nfile = "b.patch"\nfix = 2\n',
        "not earlier in series",
    ),
    "duplicate": (
        '[[patch]]\nid = "a"\nfile = "a.patch"\nfix = 1\n'
        '[[patch]]\nid = "a"\nfile = "b.patch"\nfix = 2\n',
        "duplicate patch id a",
    ),
    "incomplete": ('[[patch]]\nid = "a"\nfix = 1\n', "is incomplete"),
    "fix-not-int": ('[[patch]]\nid = "a"\nfile = "a.patch"\nfix = "one"\n', "is incomplete"),
    "escaping-file": (
        '[[patch]]\nid = "a"\nfile = "../../etc/passwd"\nfix = 1\n',
        "relative path inside patches/",
    ),
    "unknown-absent": (
        '[baselines.x]\nsource = "git"\nversion = "1"\ncommit = "'
        + "a" * 40
        + '"\nabsent = { nope = "why" }\n',
        "names unknown patches ['nope']",
    ),
    "default": ('default = "nope"\n', "unknown baseline 'nope'"),
    "not-tables": ("patch = 3\n", "`patch` must be an array of tables"),
    "baseline-not-table": ("[baselines]\nx = 1\n", "`baselines` must hold one table"),
    "requires-string": (
        '[[patch]]\nid = "a"\nfile = "a.patch"\nfix = 1\nrequires = "xy"\n',
        "expected a list of strings",
    ),
    "default-empty": ("default = []\n", "`default` must name a baseline"),
    "default-number": ("default = 3\n", "`default` must name a baseline"),
    "same-code-as-list": (
        '[baselines.x]\nsource = "pypi"\nversion = "1"\nsha256 = "' + "c" * 64 + '"\n'
        'same-code-as = ["ok"]\n',
        "baseline x: same-code-as ['ok'] must name a baseline",
    ),
    "variants-string": (
        '[baselines.x]\nsame-code-as = "ok"\n',
        "baseline ok: `variants` must be a table",
    ),
    "unknown-baseline-key": (
        '[baselines.x]\nsource = "git"\nversion = "1"\ncommit = "'
        + "a" * 40
        + '"\n[baselines.x.varients]\na = "b.patch"\n',
        "baseline x: unknown key 'varients'",
    ),
    "unknown-patch-key": (
        '[[patch]]\nid = "a"\nfile = "a.patch"\nfix = 1\nrequieres = ["b"]\n',
        "patch a: unknown key 'requieres'",
    ),
    "unknown-top-key": ('canonicle = "ok"\n', "unknown key 'canonicle'"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_ERRORS))
def test_invalid_manifest(tmp_path, tool, case):
    body, words = MANIFEST_ERRORS[case]
    root = tmp_path / "proj"
    ok = '[baselines.ok]\nsource = "git"\nversion = "1"\ncommit = "' + "b" * 40 + '"\n'
    head = "" if case == "toml" else 'canonical = "ok"\n'
    if not case.startswith("default"):
        head += 'default = "ok"\n'
    if case == "variants-string":  # on the baseline another one shares (same-code-as)
        ok += 'variants = "oops"\n'
    write(root, "patches/manifest.toml", head + body + ("" if "[baselines]" in body else ok))
    r = tool(root, "status")
    assert r.rc == 2
    msg = one_line(r.err)
    assert "manifest.toml" in msg or case == "default"
    assert words in msg
    assert sorted(p.name for p in root.rglob("*")) == ["manifest.toml", "patches"]


def test_manifest_not_found(tmp_path, tool):
    r = tool(tmp_path, "status")
    assert r.rc == 2
    assert f"manifest not found: {tmp_path / 'patches' / 'manifest.toml'}" in one_line(r.err)


def test_manifest_not_utf8_or_a_directory(tmp_path, tool):
    manifest = tmp_path / "patches" / "manifest.toml"
    manifest.parent.mkdir()
    manifest.write_bytes(b'canonical = "caf\xe9"\n')
    r = tool(tmp_path, "status")
    assert r.rc == 2 and "manifest.toml: not UTF-8 text" in one_line(r.err)
    manifest.unlink()
    manifest.mkdir()
    r = tool(tmp_path, "status")
    assert r.rc == 2 and "cannot read the manifest (Is a directory)" in one_line(r.err)
