"""What Python imports as `megatron.core`, and which installed `megatron-core` provides it.

`importlib.metadata.version("megatron-core")` alone can name another copy than the one
imported: run from a clone, `./megatron` (a vendored tree) shadows the installed package, and
the clone's `megatron_core.egg-info` (build metadata, not an installation) is found first.
Here the distribution is the installed one whose files are the imported module; a source tree
on sys.path before it is named as such.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from .errors import UserError

DIST_NAME = "megatron-core"
# the fork's record of its base and patches: megatron/core/_mcore_fixes.json, written by
# `vendor` (mcore_fixes/maint/vendor.py) and shipped with the install
INFO_NAME = "_mcore_fixes.json"


@dataclass(frozen=True)
class Imported:
    location: Path  # the folder `import megatron.core` loads
    dist: md.Distribution | None  # the installed megatron-core whose files these are
    shadowed: md.Distribution | None  # an installed megatron-core hidden by `location`

    @property
    def record(self) -> dict | None:
        """The fork's record (`_mcore_fixes.json`), or None for a pristine megatron.core."""
        return fork_record(self.location)


def fork_record(location: Path) -> dict | None:
    path = location / INFO_NAME
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is unreadable ({exc}); reinstall the fork") from None


def _is_installation(dist: md.Distribution) -> bool:
    """An installed distribution, not a source tree's build metadata (`*.egg-info` next to
    its setup.py, written by `setup.py --version` or a build, and found first from there)."""
    if dist.read_text("RECORD") is not None:
        return True
    folder = Path(str(dist.locate_file("")))
    return not any((folder / name).exists() for name in ("setup.py", "pyproject.toml"))


def editable_source(dist: md.Distribution) -> Path | None:
    """The project folder of an editable install (`pip install -e`), else None."""
    text = dist.read_text("direct_url.json")
    try:
        data = json.loads(text) if text else {}
    except ValueError:
        return None
    url = data.get("url", "") if isinstance(data, dict) else ""
    editable = isinstance(data.get("dir_info"), dict) and data["dir_info"].get("editable")
    if not editable or not url.startswith("file://"):
        return None
    return Path(unquote(urlparse(url).path))


def dist_location(dist: md.Distribution) -> Path | None:
    """The `megatron/core` folder a distribution installed (resolved), or None."""
    source = editable_source(dist)
    if source is not None:
        return (source / "megatron" / "core").resolve()
    for file in dist.files or ():
        if file.parts == ("megatron", "core", "__init__.py"):
            return Path(str(dist.locate_file(file))).resolve().parent
    return None


def imported() -> Imported:
    """What `import megatron.core` loads here; a UserError when nothing does."""
    try:
        spec = importlib.util.find_spec("megatron.core")
    except ModuleNotFoundError:  # no `megatron` package at all
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "megatron.core is not importable here: install the fork (docs/install.md), "
            "or run where a vendored ./megatron is"
        )
    location = Path(list(spec.submodule_search_locations)[0]).resolve()
    dists = [d for d in md.distributions(name=DIST_NAME) if _is_installation(d)]
    provider = next((d for d in dists if dist_location(d) == location), None)
    shadowed = None if provider else next(iter(dists), None)
    return Imported(location, provider, shadowed)


def describe(dist: md.Distribution) -> str:
    """`megatron-core VERSION (installed at FOLDER)`, with the fork or pristine said."""
    source = editable_source(dist)
    where = f"editable install of {source}" if source else f"installed in {dist.locate_file('')}"
    location = dist_location(dist)
    fork = location is not None and (location / INFO_NAME).exists()
    kind = "the mcore-fixes fork" if fork else "pristine: no mcore-fixes patch"
    return f"megatron-core {dist.version}, {kind} ({where})"


def _release(version: str) -> tuple[int, ...]:
    """`2.6.0a0+git1234` -> (2, 6, 0): an NGC or CUDA build counts as its release."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(n) for n in match.group(0).split(".")) if match else ()


def torch_minimum(record: dict) -> str | None:
    """The `torch>=X` the base's own requirements name (kept in the record), else None."""
    for req in record.get("base_metadata", {}).get("dependencies", []):
        match = re.match(r"\s*torch\s*(?:\[[^\]]*\])?\s*(.*)", req, re.IGNORECASE)
        if match and not re.match(r"[A-Za-z0-9_.-]", match.group(1)):
            low = re.search(r">=\s*([0-9][0-9.]*)", match.group(1))
            return low.group(1) if low else None
    return None


def missing_runtime(record: dict) -> str | None:
    """What the installed fork needs at run time that does not import here (pip does not
    install torch for it, nor anything with --no-deps), as one line saying how to install it;
    None when torch (new enough for the base) and psutil import."""
    problems, fixes = [], []
    need = torch_minimum(record)
    spec = f"torch>={need}" if need else "torch"
    try:
        import torch  # noqa: PLC0415

        found = str(getattr(torch, "__version__", "?"))
        if need and _release(found) < _release(need):
            problems.append(
                f"torch {found} is older than {need}, what base {record['baseline']} requires"
            )
            fixes.append(f"upgrade to {spec} with the command pytorch.org gives for your machine")
    except Exception as exc:  # noqa: BLE001 - a broken torch fails with more than ImportError
        first = (str(exc).splitlines() or [""])[0]  # one line, whatever the import raised
        problems.append(f"torch does not import ({type(exc).__name__}: {first})")
        fixes.append(f"install {spec} with the command pytorch.org gives for your machine")
    if fixes:
        fixes[-1] += " (a bare `pip install torch` may replace a CUDA build by another)"
    try:
        import psutil  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001
        problems.append("psutil does not import (saving a torch_dist checkpoint needs it)")
        fixes.append("`pip install psutil`")
    if not problems:
        return None
    return f"{'; '.join(problems)}: {', and '.join(fixes)}"


def fix_name(entry: dict) -> str:
    """The fix of a record's entry as users read it (records before names: `fix N`)."""
    return entry.get("name") or f"fix {entry['fix']}"
