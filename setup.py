"""Build the vendored, patched `megatron/core` as the distribution `megatron-core`.

`pip install .` materializes the manifest's default baseline first if `megatron/` is absent
(`python -m mcore_fixes vendor`). The version is `<base>+fixes.<n>`, n = patches applied; the
base's own requirements and extras are kept; the applied / not-applicable patches are recorded
in `megatron/core/_mcore_fixes.json` and in the package summary (`python -m mcore_fixes info`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_namespace_packages, setup

ROOT = Path(__file__).resolve().parent
INFO = ROOT / "megatron" / "core" / "_mcore_fixes.json"
sys.path.insert(0, str(ROOT))
from mcore_fixes.errors import UserError  # noqa: E402
from mcore_fixes.vendor import local_edits  # noqa: E402


def vendored_info() -> dict:
    """The vendored tree's record; `vendor` first if there is none (its report on stderr)."""
    if not INFO.exists():
        print(
            "mcore-fixes: no vendored megatron/ yet: downloading the pinned megatron-core sdist "
            "(unless cached) and applying the patches (python -m mcore_fixes vendor)",
            file=sys.stderr,
        )
        vendor = [sys.executable, "-m", "mcore_fixes", "vendor"]
        if subprocess.run(vendor, cwd=ROOT, stdout=sys.stderr).returncode != 0:
            sys.exit("mcore-fixes: `python -m mcore_fixes vendor` failed (see above)")
    return json.loads(INFO.read_text())


def clean_build_dirs() -> None:
    """setuptools reuses build/lib*: files of a previously built baseline would ship too."""
    for pattern in ("lib", "lib.*", "temp.*", "bdist.*"):
        for path in (ROOT / "build").glob(pattern):
            shutil.rmtree(path)


def local_label() -> str:
    """`.edited` for a tree with edits not exported into the patches (not what info says)."""
    try:
        edits = local_edits(ROOT)
    except UserError as exc:  # e.g. a corrupt build/vendor.json
        sys.exit(f"mcore-fixes: {exc}")
    if edits is None:
        sys.exit("mcore-fixes: an interrupted `vendor` left megatron/ half written; vendor again")
    return ".edited" if edits else ""


def package_data(top: Path) -> dict[str, list[str]]:
    """Every non-Python file shipped inside megatron/core (docs, the C++ helper source, ...)."""
    data: dict[str, list[str]] = {}
    for path in top.rglob("*"):
        if (
            path.is_file()
            and path.suffix not in (".py", ".pyc", ".so")
            and "__pycache__" not in path.parts
        ):
            package = ".".join(path.parent.relative_to(ROOT).parts)
            data.setdefault(package, []).append(path.name)
    return data


def helpers_extension() -> Extension:
    import pybind11

    return Extension(
        "megatron.core.datasets.helpers_cpp",
        sources=["megatron/core/datasets/helpers.cpp"],
        language="c++",
        include_dirs=[pybind11.get_include()],
        extra_compile_args=["-O3", "-Wall", "-std=c++17"],
    )


def fork_summary(info: dict) -> str:
    """What this build contains, for the package metadata (also: python -m mcore_fixes info)."""
    lines = [f"# megatron-core {info['baseline']} + mcore-fixes", "", f"Base pin: {info['pin']}"]
    lines.append("")
    lines += [f"- applied: fix {p['fix']} `{p['id']}` ({p['file']})" for p in info["applied"]]
    lines += [
        f"- not applied: fix {p['fix']} `{p['id']}`: {p['state']}: {p['reason']}"
        for p in info["not_applied"]
    ]
    return "\n".join(lines) + "\n\n"


clean_build_dirs()
info = vendored_info()
base = info["base_metadata"]
applied = [p["id"] for p in info["applied"]]
setup(
    name="megatron-core",
    version=f"{info['version']}+fixes.{len(applied)}{local_label()}",
    description=(
        f"Megatron Core {info['baseline']} with the mcore-fixes series "
        f"({', '.join(applied) or 'no patch applicable'})"
    ),
    long_description=fork_summary(info) + (ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache 2.0",
    python_requires=base["requires-python"],
    install_requires=base["dependencies"],
    extras_require=base["optional-dependencies"],
    packages=find_namespace_packages(include=["megatron.core", "megatron.core.*", "mcore_fixes"]),
    package_data=package_data(ROOT / "megatron" / "core"),
    ext_modules=[helpers_extension()],
    zip_safe=False,
)
