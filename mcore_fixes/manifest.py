"""The series manifest (`patches/manifest.toml`): baselines, pins, and which patch file applies."""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
PYTHON_RE = re.compile(r"^3\.\d+$")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
ABBREV_RE = re.compile(r"^[0-9a-f]{7,40}$")
UPSTREAM_PULL = "https://github.com/NVIDIA/Megatron-LM/pull/"
ORIGINS = ("upstream", "upstream-pr")  # a merged upstream commit / an open upstream PR


@dataclass(frozen=True)
class Patch:
    id: str
    file: str
    fix: int  # several patches may share one fix number (one upstream PR, several commits)
    requires: tuple[str, ...] = ()
    proof: str = ""  # our CPU proof, relative to the project root (tests/proofs/...)
    # the upstream commit that is this patch in the PR for the canonical baseline (`upstream`
    # cherry-picks it with -x in place of the patch); "" = the patch is our own commit
    upstream_commit: str = ""
    # provenance of a patch that carries upstream's own fix (the release lines): the PR number,
    # "upstream" (a merged commit) or "upstream-pr" (an open PR, carried until it merges), and
    # the upstream branches that have it; all empty for our own patches
    upstream_pr: int = 0
    origin: str = ""
    upstream_branches: tuple[str, ...] = ()
    # a carried upstream fix's row of README's "Am I affected?" (mcore_fixes/maint/affected.py): the
    # runs it damages (flags), what goes wrong, and the `audit` check that finds it in a
    # checkpoint or why none does; our own fixes' rows are their [fixes.N] tables (Fix)
    affects: str = ""
    damage: str = ""
    audit: str = ""
    audit_gap: str = ""

    @property
    def upstream_url(self) -> str:
        """The upstream PR this patch carries ("" for our own patches)."""
        return f"{UPSTREAM_PULL}{self.upstream_pr}" if self.upstream_pr else ""

    def upstream_info(self) -> dict:
        """Where the upstream fix this patch carries comes from (JSON of status and info)."""
        return {
            "pr": self.upstream_pr,
            "url": self.upstream_url,
            "origin": self.origin,
            "commit": self.upstream_commit,
            "branches": list(self.upstream_branches),
        } | ({"affects": self.affects} if self.affects else {})


@dataclass(frozen=True)
class Fix:
    """One fix of ours (`fix = N` of its patches): its name and its row of README's "Am I
    affected?" table. Upstream's own fixes, carried, are named by their PR (their patches)."""

    number: int
    name: str  # what it fixes, as `info`, `vendor`, the README and docs/fixes.md name it
    affects: str = ""  # the runs it damages: pretrain_gpt.py flags, Megatron Bridge settings
    damage: str = ""  # what goes wrong without it
    audit: str = ""  # the `audit` check that finds its damage in a checkpoint
    audit_gap: str = ""  # where there is none: why


@dataclass(frozen=True)
class Baseline:
    name: str
    source: str  # "pypi" or "git"
    version: str
    sha256: str = ""  # pypi
    ref: str = ""  # git
    commit: str = ""  # git
    variants: dict[str, str] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)
    # patch id -> where upstream fixed it its own way (DEP-3 Applied-Upstream: commit, PR)
    fixed_upstream: dict[str, str] = field(default_factory=dict)
    # patch id -> why its variant here changes other lines than the canonical (variants.py)
    backports: dict[str, str] = field(default_factory=dict)
    # patch id -> the upstream commit (PR) this baseline already has: the patch reverse-applies
    # (e.g. a release that shipped the commit); main and dev: `upstream-branches` of the patch
    applied_upstream: dict[str, str] = field(default_factory=dict)
    python: str = ""  # oldest Python a fork of this base installs on ("3.12"); "" = any
    same_code_as: str = ""  # the baseline whose variants / absent / fixed-upstream it shares

    @property
    def is_git(self) -> bool:
        return self.source == "git"

    @property
    def pin(self) -> str:
        """What identifies the baseline's files: sdist sha256 or commit id."""
        return self.commit if self.is_git else self.sha256

    def installs_on(self, version: tuple[int, int]) -> bool:
        """Whether a fork of this base installs on Python `version` (major, minor)."""
        if not self.python:
            return True
        major, minor = self.python.split(".")
        return version >= (int(major), int(minor))


@dataclass(frozen=True)
class Manifest:
    root: Path  # the patches/ directory
    canonical: str
    default: str  # the first of `defaults` whose fork installs on the running Python
    patches: tuple[Patch, ...]
    baselines: dict[str, Baseline]
    defaults: tuple[str, ...] = ()  # the manifest's preference order
    fixes: dict[int, Fix] = field(default_factory=dict)  # [fixes.N]: our fixes' names and rows

    def baseline(self, name: str) -> Baseline:
        try:
            return self.baselines[name]
        except KeyError:
            known = ", ".join(self.baselines)
            raise UserError(f"unknown baseline {name!r}; known baselines: {known}") from None

    def patch(self, patch_id: str) -> Patch:
        for p in self.patches:
            if p.id == patch_id:
                return p
        known = ", ".join(p.id for p in self.patches)
        raise UserError(f"unknown patch {patch_id!r}; known patches: {known}")

    def fix_label(self, patch: Patch) -> str:
        """What users read for the fix a patch belongs to: `upstream #PR` for upstream's own
        fix, carried; the [fixes.N] name of ours (`fix N` where the manifest names none)."""
        if patch.origin:
            return f"upstream #{patch.upstream_pr}"
        fix = self.fixes.get(patch.fix)
        return fix.name if fix else f"fix {patch.fix}"

    def upstream_has(self, baseline: Baseline, patch: Patch) -> str:
        """Where `baseline` already has `patch` as upstream's code ("" where it does not): the
        manifest's fixed-upstream / applied-upstream entry, or the branch of `upstream-branches`
        it follows."""
        if patch.id in baseline.fixed_upstream:
            return baseline.fixed_upstream[patch.id]
        if patch.id in baseline.applied_upstream:
            return baseline.applied_upstream[patch.id]
        if baseline.is_git and baseline.ref in patch.upstream_branches:
            return f"{patch.upstream_commit[:10]} (#{patch.upstream_pr}) on {baseline.ref}"
        return ""

    def patch_file(self, baseline: Baseline, patch: Patch) -> Path | None:
        """The file that applies `patch` to `baseline`, or None where the fix is absent."""
        if patch.id in baseline.absent:
            return None
        return self.root / baseline.variants.get(patch.id, patch.file)

    def default_for(self, version: tuple[int, int]) -> str:
        """The preferred default baseline whose fork installs on Python `version`."""
        for name in self.defaults:
            if self.baselines[name].installs_on(version):
                return name
        return self.defaults[-1]

    def proof_path(self, patch: Patch) -> Path | None:
        """Our CPU proof of `patch` (absolute), or None: prove then uses the patch's tests."""
        return self.root.parent / patch.proof if patch.proof else None


_SHARED = ("variants", "absent", "fixed-upstream", "applied-upstream", "backports")

# Every key the manifest may use, in one place: add a key here where the loader reads it. Any
# other key is refused by name (a typo such as `varients` would otherwise be ignored silently).
TOP_KEYS = frozenset({"canonical", "default", "patch", "fixes", "baselines"})
PATCH_KEYS = frozenset(
    {
        "id",
        "file",
        "fix",
        "requires",
        "proof",
        "upstream-commit",
        "upstream-pr",
        "origin",
        "upstream-branches",
        "affects",
        "damage",
        "audit",
        "audit-gap",
    }
)
FIX_KEYS = frozenset({"name", "affects", "damage", "audit", "audit-gap"})
FIX_NAME_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
BASELINE_KEYS = frozenset(
    {"source", "version", "sha256", "ref", "commit", "python", "same-code-as", *_SHARED}
)


def _known_keys(entry: dict, known: frozenset[str], where: str) -> None:
    unknown = sorted(set(entry) - known)
    if unknown:
        raise UserError(
            f"{where}: unknown key {unknown[0]!r} (known keys: {', '.join(sorted(known))})"
        )


def _tables(entry: dict, where: str) -> dict[str, dict[str, str]]:
    """The baseline's `variants`, `absent`, ... tables (patch id -> text), each checked."""
    tables: dict[str, dict[str, str]] = {}
    for key in _SHARED:
        value = entry.get(key, {})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise UserError(
                f'{where}: `{key}` must be a table of patch id = "text" entries, not {value!r}'
            )
        tables[key] = value
    return tables


def _str_list(value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"expected a list of strings, got {value!r}")
    return value


def _rel_file(value: object) -> str:
    """A patch file name relative to patches/, never leaving it."""
    if not isinstance(value, str) or not value or value.startswith("/") or ".." in value.split("/"):
        raise ValueError(f"patch file {value!r} must be a relative path inside patches/")
    return value


def _proof_file(value: object) -> str:
    """A proof file relative to the project root, under tests/, never leaving the project."""
    if value is None or value == "":
        return ""
    if (
        not isinstance(value, str)
        or value.startswith("/")
        or ".." in value.split("/")
        or not value.startswith("tests/")
        or not value.endswith(".py")
    ):
        raise ValueError(f"proof {value!r} must be a relative path tests/....py in this project")
    return value


def _upstream_commit(value: object) -> str:
    """A Megatron-LM commit id (7 to 40 hex digits), or "" where not given."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or not ABBREV_RE.match(value):
        raise ValueError(f"upstream-commit {value!r} must be a commit id (7 to 40 hex digits)")
    return value


def _text(entry: dict, key: str) -> str:
    """An optional text field of a README row (`affects`, `damage`, `audit`, `audit-gap`)."""
    value = entry.get(key, "")
    if not isinstance(value, str):
        raise ValueError(f"{key} {value!r} must be a string")
    if value and key == "audit" and entry.get("audit-gap"):
        raise ValueError(
            "audit names the check that finds the damage; audit-gap says why none "
            "does: give one of them"
        )
    return value


def _fixes(data: dict, path: Path) -> dict[int, Fix]:
    """The [fixes.N] tables: each fix of ours by number, with its name and README row."""
    tables = data.get("fixes", {})
    if not isinstance(tables, dict) or not all(isinstance(e, dict) for e in tables.values()):
        raise UserError(f"{path}: `fixes` must hold one table per fix ([fixes.N])")
    fixes: dict[int, Fix] = {}
    for key, entry in tables.items():
        where = f"{path}: fixes.{key}"
        _known_keys(entry, FIX_KEYS, where)
        try:
            number = int(key)
            name = entry["name"]
            if not isinstance(name, str) or not FIX_NAME_RE.match(name):
                raise ValueError(f"name {name!r} must be lower-case words joined by '-'")
            fix = Fix(
                number=number,
                name=name,
                affects=_text(entry, "affects"),
                damage=_text(entry, "damage"),
                audit=_text(entry, "audit"),
                audit_gap=_text(entry, "audit-gap"),
            )
        except (KeyError, ValueError) as exc:
            raise UserError(f"{where} is incomplete or malformed ({exc})") from None
        if name in {f.name for f in fixes.values()}:
            raise UserError(f"{where}: the name {name!r} is another fix's")
        fixes[number] = fix
    return fixes


def _origin(entry: dict) -> tuple[int, str, tuple[str, ...]]:
    """`upstream-pr`, `origin` and `upstream-branches` of a [[patch]] entry, checked together."""
    pr, origin = entry.get("upstream-pr", 0), entry.get("origin", "")
    branches = tuple(_str_list(entry.get("upstream-branches", [])))
    if not isinstance(pr, int) or isinstance(pr, bool) or pr < 0:
        raise ValueError(f"upstream-pr {pr!r} must be a pull-request number")
    if origin and origin not in ORIGINS:
        raise ValueError(f"origin {origin!r} must be one of {', '.join(ORIGINS)}")
    if origin and not pr:
        raise ValueError(f"origin {origin!r} needs the upstream-pr it comes from")
    if origin == "upstream" and not (branches and entry.get("upstream-commit")):
        raise ValueError('origin "upstream" needs upstream-commit and upstream-branches')
    if origin == "upstream-pr" and branches:
        raise ValueError('origin "upstream-pr" (not merged) cannot name upstream-branches')
    return pr, origin, branches


def load(path: Path) -> Manifest:
    """Parse and validate a manifest; every problem is a UserError naming the entry."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"manifest not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:  # a directory, unreadable, ...
        raise UserError(f"{path}: cannot read the manifest ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: invalid TOML: {exc}") from None

    entries, tables = data.get("patch", []), data.get("baselines", {})
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise UserError(f"{path}: `patch` must be an array of tables ([[patch]] entries)")
    if not isinstance(tables, dict) or not all(isinstance(e, dict) for e in tables.values()):
        raise UserError(f"{path}: `baselines` must hold one table per baseline")
    _known_keys(data, TOP_KEYS, str(path))
    patches: list[Patch] = []
    for entry in entries:
        _known_keys(entry, PATCH_KEYS, f"{path}: patch {entry.get('id', '(no id)')}")
        try:
            if not isinstance(entry["id"], str) or not entry["id"]:
                raise ValueError(f"id {entry['id']!r} must be a non-empty string")
            pr, origin, branches = _origin(entry)
            patch = Patch(
                id=entry["id"],
                file=_rel_file(entry["file"]),
                fix=int(entry["fix"]),
                requires=tuple(_str_list(entry.get("requires", []))),
                proof=_proof_file(entry.get("proof")),
                upstream_commit=_upstream_commit(entry.get("upstream-commit")),
                upstream_pr=pr,
                origin=origin,
                upstream_branches=branches,
                affects=_text(entry, "affects"),
                damage=_text(entry, "damage"),
                audit=_text(entry, "audit"),
                audit_gap=_text(entry, "audit-gap"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{path}: [[patch]] entry {entry!r} is incomplete ({exc})") from None
        seen = {p.id for p in patches}
        missing = [r for r in patch.requires if r not in seen]
        if missing:
            raise UserError(f"{path}: patch {patch.id} requires {missing}, not earlier in series")
        if patch.id in seen:
            raise UserError(f"{path}: duplicate patch id {patch.id}")
        patches.append(patch)

    ids = {p.id for p in patches}
    baselines: dict[str, Baseline] = {}
    for name, entry in tables.items():
        _known_keys(entry, BASELINE_KEYS, f"{path}: baseline {name}")
        own = _tables(entry, f"{path}: baseline {name}")
        shared = entry.get("same-code-as", "")
        if shared:  # the variants etc. of that baseline, then this one's own entries
            base = tables.get(shared) if isinstance(shared, str) else None
            if base is None or base.get("same-code-as"):
                raise UserError(
                    f"{path}: baseline {name}: same-code-as {shared!r} must name a baseline "
                    "that has its own variants (no chains)"
                )
            theirs = _tables(base, f"{path}: baseline {shared}")
            entry = {**entry, **{k: {**theirs[k], **own[k]} for k in _SHARED}}
        source = entry.get("source")
        try:
            b = Baseline(
                name=name,
                source=source,
                version=str(entry["version"]),
                sha256=str(entry.get("sha256", "")),
                ref=str(entry.get("ref", "")),
                commit=str(entry.get("commit", "")),
                variants={k: _rel_file(v) for k, v in dict(entry.get("variants", {})).items()},
                absent={k: str(v) for k, v in dict(entry.get("absent", {})).items()},
                fixed_upstream={
                    k: str(v) for k, v in dict(entry.get("fixed-upstream", {})).items()
                },
                backports={k: str(v) for k, v in dict(entry.get("backports", {})).items()},
                applied_upstream={
                    k: str(v) for k, v in dict(entry.get("applied-upstream", {})).items()
                },
                python=str(entry.get("python", "")),
                same_code_as=str(shared),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{path}: baseline {name} is incomplete or malformed ({exc})") from None
        if source == "pypi" and not SHA256_RE.match(b.sha256):
            raise UserError(f"{path}: baseline {name}: pypi source needs a sha256 pin")
        if source == "git" and not COMMIT_RE.match(b.commit):
            raise UserError(f"{path}: baseline {name}: git source needs a full 40-hex commit")
        if source not in ("pypi", "git"):
            raise UserError(f"{path}: baseline {name}: source must be 'pypi' or 'git'")
        if b.python and not PYTHON_RE.match(b.python):
            raise UserError(f'{path}: baseline {name}: python must read like "3.12"')
        unknown = (
            set(b.variants)
            | set(b.absent)
            | set(b.fixed_upstream)
            | set(b.applied_upstream)
            | set(b.backports)
        ) - ids
        if unknown:
            raise UserError(f"{path}: baseline {name} names unknown patches {sorted(unknown)}")
        baselines[name] = b

    raw_default, canonical = data.get("default", ""), data.get("canonical", "")
    if isinstance(raw_default, str):
        defaults: tuple[str, ...] = (raw_default,)
    elif raw_default and isinstance(raw_default, list):
        defaults = tuple(raw_default)
    else:
        defaults = ()
    if not defaults or not all(isinstance(d, str) for d in defaults):
        raise UserError(
            f"{path}: `default` must name a baseline, or list baselines in order of preference "
            f"(not {raw_default!r})"
        )
    if not isinstance(canonical, str):
        raise UserError(f"{path}: `canonical` must name a baseline (not {canonical!r})")
    for name in (canonical, *defaults):
        if name not in baselines:
            known = ", ".join(baselines)
            raise UserError(f"{path}: unknown baseline {name!r}; known baselines: {known}")
    manifest = Manifest(
        root=path.parent,
        canonical=canonical,
        default="",
        patches=tuple(patches),
        baselines=baselines,
        defaults=defaults,
        fixes=_fixes(data, path),
    )
    object.__setattr__(manifest, "default", manifest.default_for(sys.version_info[:2]))
    return manifest
