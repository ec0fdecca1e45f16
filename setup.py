"""Build the vendored, patched `megatron/core` as the distribution `megatron-core`.

`pip install .` materializes the manifest's default baseline for this Python first if
`megatron/` is absent (`python -m mcore_fixes vendor`), holds a base whose fork cannot install
on this Python, or holds another Python's default (a base chosen with `vendor --baseline`, or
edited, is kept); it says which base it builds (stderr: `pip install -v` shows it).
The version is `<base>+fixes.<n>`, n = patches applied; the base's own requirements and
extras are kept; the applied / not-applicable patches are recorded in
`megatron/core/_mcore_fixes.json` and in the package summary (`python -m mcore_fixes info`).
The tool is installed too, carrying patches/: `python -m mcore_fixes apply` from anywhere.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_namespace_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
INFO = ROOT / "megatron" / "core" / "_mcore_fixes.json"
sys.path.insert(0, str(ROOT))
from mcore_fixes import manifest  # noqa: E402
from mcore_fixes.errors import UserError  # noqa: E402
from mcore_fixes.installed import fix_name  # noqa: E402
from mcore_fixes.maint.vendor import unexported_edits, vendored_choice  # noqa: E402


def _here() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def say(line: str) -> None:
    print(f"mcore-fixes: {line}", file=sys.stderr)  # pip shows it with -v, and on failure


def rebuild_args() -> list[str] | None:
    """`vendor` arguments that replace the vendored base by the default for this Python, or
    None where it is built as it is. Replaced: a base whose fork cannot install here (e.g.
    0.19.2 on 3.11), and one that another Python chose by default (0.16.1, vendored by an
    install on 3.11, when 3.12 installs): only `vendor --baseline` keeps a base. A tree with
    edits is never replaced: built as it is, or, where it cannot install here, the error names
    the one command that fixes it."""
    try:
        m = manifest.load(ROOT / "patches" / "manifest.toml")
        b = m.baselines.get(json.loads(INFO.read_text())["baseline"])
        if b is None or b.name == m.default:
            return None
        choice = vendored_choice(ROOT)
        chosen = choice is None or choice[1]  # no record of how (no build/): kept as chosen
        edits = unexported_edits(ROOT)
    except UserError as exc:
        sys.exit(f"mcore-fixes: {exc}")
    here = _here()
    if b.installs_on(sys.version_info[:2]):
        if chosen or edits is not False:
            why = "chosen with `vendor --baseline`" if chosen else "it has edits"
            say(
                f"building the vendored {b.name} ({why}), not {m.default}, the default on "
                f"Python {here}: `python -m mcore_fixes vendor --force` first builds {m.default}"
            )
            return None
        say(
            f"megatron/ holds {b.name}, the default of the Python that vendored it; "
            f"vendoring {m.default}, the default on Python {here} (`python -m mcore_fixes "
            f"vendor --baseline {b.name}` first keeps {b.name})"
        )
        return ["--force"]
    why = f"megatron/ holds {b.name}, whose fork needs Python >= {b.python}, not {here}"
    if edits is not False:  # edited, or None: an interrupted vendor
        fix = f"python -m mcore_fixes vendor --baseline {m.default} --force"
        sys.exit(f"mcore-fixes: {why}, and has edits: run `{fix}` (`export` first keeps them)")
    say(f"{why}: vendoring {m.default}, the default here")
    return ["--baseline", m.default, "--force"]


def vendored_info() -> dict:
    """The vendored tree's record; `vendor` first if there is none or it is not the base to
    build here (its report on stderr); then which base this Python builds, said."""
    again = rebuild_args() if INFO.exists() else None
    if again is not None or not INFO.exists():
        if again is None:
            say(
                "no vendored megatron/ yet: downloading the pinned megatron-core "
                "sdist (unless cached) and applying the patches (python -m mcore_fixes vendor)"
            )
        vendor = [sys.executable, "-m", "mcore_fixes", "vendor", *(again or [])]
        if subprocess.run(vendor, cwd=ROOT, stdout=sys.stderr).returncode != 0:
            sys.exit(f"mcore-fixes: `python {' '.join(vendor[1:])}` failed (see above)")
    info = json.loads(INFO.read_text())
    say(
        f"building megatron-core {info['version']}+fixes.{len(info['applied'])} for Python "
        f"{_here()}: base {info['baseline']}, {len(info['applied'])} patches applied"
    )
    return info


def clean_build_dirs() -> None:
    """setuptools reuses build/lib*: files of a previously built baseline would ship too."""
    for pattern in ("lib", "lib.*", "temp.*", "bdist.*"):
        for path in (ROOT / "build").glob(pattern):
            shutil.rmtree(path)


def local_label() -> str:
    """`.edited` for a tree with edits not exported into the patches (not what info says),
    told from build/vendor.json or, without build/, from the tree's own record."""
    try:
        edited = unexported_edits(ROOT)
    except UserError as exc:  # e.g. a corrupt build/vendor.json
        sys.exit(f"mcore-fixes: {exc}")
    if edited is None:
        sys.exit("mcore-fixes: an interrupted `vendor` left megatron/ half written; vendor again")
    return ".edited" if edited else ""


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


class BuildPyWithSeries(build_py):
    """Ships patches/ (manifest and patch files) inside the installed mcore_fixes: its
    `apply`, `status` and `info` then run from any directory."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install runs the tool from this clone
            target = Path(self.build_lib) / "mcore_fixes" / "patches"
            self.copy_tree(str(ROOT / "patches"), str(target))


def requirements(base: dict) -> list[str]:
    """The base's requirements but torch: pip must neither pull a torch (a multi-GB CUDA build)
    nor replace the user's (a CUDA or NGC build: `2.6.0a0+...` fails `torch>=2.6.0`). The
    environment brings torch first (docs/install.md); psutil is added (it pulls no torch)."""
    name = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
    kept = [r for r in base["dependencies"] if name.match(r).group(1).lower() != "torch"]
    # psutil: saving a torch_dist checkpoint imports it, and the base does not declare it.
    has_psutil = any(name.match(r).group(1).lower() == "psutil" for r in kept)
    return kept if has_psutil else [*kept, "psutil"]


def fork_summary(info: dict) -> str:
    """What this build contains, for the package metadata (also: python -m mcore_fixes info)."""
    lines = [f"# megatron-core {info['baseline']} + mcore-fixes", "", f"Base pin: {info['pin']}"]
    lines.append("")
    lines += [f"- applied: `{p['id']}` ({fix_name(p)}; {p['file']})" for p in info["applied"]]
    lines += [
        f"- not applied: `{p['id']}` ({fix_name(p)}): {p['state']}: {p['reason']}"
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
    install_requires=requirements(base),
    extras_require=base["optional-dependencies"],
    packages=find_namespace_packages(
        include=[
            "megatron.core",
            "megatron.core.*",
            "mcore_fixes",
            "mcore_fixes.audit",
            "mcore_fixes.maint",
        ]
    ),
    package_data=package_data(ROOT / "megatron" / "core"),
    ext_modules=[helpers_extension()],
    cmdclass={"build_py": BuildPyWithSeries},
    zip_safe=False,
)
