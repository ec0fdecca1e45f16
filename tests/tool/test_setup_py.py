"""setup.py (`pip install .`): quiet `--version`, no stale build output, honest labels."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from toolworld import MAIN

pytestmark = pytest.mark.skipif(
    not (importlib.util.find_spec("setuptools") and importlib.util.find_spec("pybind11")),
    reason="setup.py needs setuptools and pybind11 (the build requirements)",
)


@pytest.fixture
def clone(world, tmp_path) -> Path:
    """The toy project with this repository's setup.py, README.md and tool, nothing vendored."""
    root = world.project(tmp_path / "clone")
    for name in ("setup.py", "README.md"):
        shutil.copy(MAIN / name, root / name)
    shutil.copytree(
        MAIN / "mcore_fixes", root / "mcore_fixes", ignore=shutil.ignore_patterns("__pycache__")
    )
    return root


def version(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "setup.py", "-q", "--version"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_version_is_quiet_and_labels_unexported_edits(clone):
    r = version(clone)  # vendors first: its report goes to stderr
    assert r.returncode == 0, r.stderr
    assert r.stdout == "0.1.0+fixes.3\n"
    assert (clone / "megatron/core/calc.py").exists()
    calc = clone / "megatron/core/calc.py"
    calc.write_text(calc.read_text() + "# not exported\n")
    assert version(clone).stdout == "0.1.0+fixes.3.edited\n"
    (clone / "megatron/core/util.py").unlink()
    calc.write_text(calc.read_text().replace("# not exported\n", ""))
    assert version(clone).stdout == "0.1.0+fixes.3.edited\n"


def test_first_build_says_it_downloads_and_patches(clone):
    r = version(clone)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0] == (
        "mcore-fixes: no vendored megatron/ yet: downloading the pinned megatron-core sdist "
        "(unless cached) and applying the patches (python -m mcore_fixes vendor)"
    )
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert version(clone).stderr == (  # vendored: only which base it builds
        f"mcore-fixes: building megatron-core 0.1.0+fixes.3 for Python {here}: base 0.1.0, "
        "3 patches applied\n"
    )


def test_stale_build_output_is_removed_and_our_state_kept(clone):
    stale = [
        clone / "build/lib/megatron/core/only_in_016.py",
        clone / "build/lib.linux-x86_64-cpython-311/megatron/core/old.py",
        clone / "build/bdist.linux-x86_64/wheel/x.py",
        clone / "build/temp.linux-x86_64-cpython-311/helpers.o",
    ]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("stale\n")
    r = version(clone)
    assert r.returncode == 0, r.stderr
    assert not any(path.exists() for path in stale)
    assert (clone / "build/vendor.json").exists() and (clone / "build/trees/0.1.0").is_dir()


def test_vendor_failure_is_one_line(clone):
    (clone / "patches/0001-fix-mean.patch").write_text("garbage\n")
    r = version(clone)
    assert r.returncode != 0 and r.stdout == ""
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "mcore-fixes: `python -m mcore_fixes vendor` failed (see above)"
    )


def test_corrupt_vendor_state_is_one_line(clone):
    assert version(clone).returncode == 0
    (clone / "build/vendor.json").write_text("{")
    r = version(clone)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "vendor.json is corrupt" in r.stderr.strip().splitlines()[-1]


def unfit_for_this_python(clone: Path, baseline: str) -> None:
    """Declare that a fork of `baseline` needs a Python newer than any (like 0.19.2 on 3.11)."""
    manifest = clone / "patches/manifest.toml"
    header = f'[baselines."{baseline}"]\n'
    manifest.write_text(manifest.read_text().replace(header, header + 'python = "3.99"\n'))


def test_a_vendored_base_that_cannot_install_here_is_replaced_by_the_default(clone):
    unfit_for_this_python(clone, "core_v0.2.0")
    vendor = [sys.executable, "-m", "mcore_fixes", "vendor", "--baseline", "core_v0.2.0"]
    r = subprocess.run(vendor, cwd=clone, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "its tree still serves tests here" in r.stdout, r.stderr
    r = version(clone)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "0.1.0+fixes.3\n"
    assert "megatron/ holds core_v0.2.0, whose fork needs Python >= 3.99" in r.stderr
    assert "vendoring 0.1.0, the default here" in r.stderr


def test_a_base_that_cannot_install_here_with_edits_names_the_command(clone):
    unfit_for_this_python(clone, "core_v0.2.0")
    vendor = [sys.executable, "-m", "mcore_fixes", "vendor", "--baseline", "core_v0.2.0"]
    assert subprocess.run(vendor, cwd=clone, capture_output=True, timeout=120).returncode == 0
    calc = clone / "megatron/core/calc.py"
    calc.write_text(calc.read_text() + "# an edit\n")
    r = version(clone)
    assert r.returncode != 0 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "mcore-fixes: megatron/ holds core_v0.2.0, whose fork needs Python >= 3.99, not "
        f"{sys.version_info[0]}.{sys.version_info[1]}, and has edits: run `python -m mcore_fixes "
        "vendor --baseline 0.1.0 --force` (`export` first keeps them)"
    )
    assert calc.read_text().endswith("# an edit\n")


def test_the_build_ships_the_series_with_the_tool(clone, tmp_path):
    lib = tmp_path / "lib"
    r = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)],
        cwd=clone, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    shipped = lib / "mcore_fixes" / "patches"
    assert sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file()) == sorted(
        p.relative_to(clone / "patches") for p in (clone / "patches").rglob("*") if p.is_file()
    )
    assert not (clone / "mcore_fixes" / "patches").exists()  # nothing written into the clone


def test_the_fork_never_makes_pip_pull_or_replace_torch(clone, tmp_path):
    # The toy base requires ["torch", "numpy"], like megatron-core's `torch>=2.6.0`.
    r = subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)],
        cwd=clone, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    requires = (tmp_path / "megatron_core.egg-info" / "requires.txt").read_text().splitlines()
    assert "numpy" in requires and not any(line.startswith("torch") for line in requires)
    assert "psutil" in requires  # a torch_dist save needs it; the base does not declare it


def test_a_base_chosen_with_vendor_baseline_is_built_and_said(clone):
    vendor = [sys.executable, "-m", "mcore_fixes", "vendor", "--baseline", "core_v0.2.0"]
    r = subprocess.run(vendor, cwd=clone, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = version(clone)
    assert r.returncode == 0 and r.stdout.startswith("0.2.0+fixes."), r.stderr
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert (
        "mcore-fixes: building the vendored core_v0.2.0 (chosen with `vendor --baseline`), not "
        f"0.1.0, the default on Python {here}: `python -m mcore_fixes vendor --force` first "
        "builds 0.1.0"
    ) in r.stderr
    assert f"mcore-fixes: building megatron-core 0.2.0+fixes.2 for Python {here}: base " in r.stderr


def default_is(clone: Path, name: str) -> None:
    manifest = clone / "patches/manifest.toml"
    text = re.sub(r'(?m)^default = ".*"$', f'default = "{name}"', manifest.read_text(), count=1)
    manifest.write_text(text)


def test_another_pythons_default_is_replaced_by_this_ones(clone):
    """A clone built by pip on one Python holds that Python's default base (0.16.1 on 3.11);
    pip on another Python builds its own default (0.19.2 on 3.12), and says so. Here the two
    Pythons are one Python under two manifests' defaults."""
    default_is(clone, "core_v0.2.0")
    r = version(clone)  # the first build: vendors the default, chosen by no one
    assert r.returncode == 0 and r.stdout.startswith("0.2.0+fixes."), r.stderr
    default_is(clone, "0.1.0")
    r = version(clone)
    assert r.returncode == 0 and r.stdout == "0.1.0+fixes.3\n", r.stderr
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert (
        "mcore-fixes: megatron/ holds core_v0.2.0, the default of the Python that vendored it; "
        f"vendoring 0.1.0, the default on Python {here}"
    ) in r.stderr
    assert f"building megatron-core 0.1.0+fixes.3 for Python {here}: base 0.1.0" in r.stderr
    # edited: built as it is, said so; nothing of the edit lost
    calc = clone / "megatron/core/calc.py"
    calc.write_text(calc.read_text() + "# an edit\n")
    default_is(clone, "core_v0.2.0")
    r = version(clone)
    assert r.stdout == "0.1.0+fixes.3.edited\n" and "(it has edits)" in r.stderr, r.stderr
    assert calc.read_text().endswith("# an edit\n")
