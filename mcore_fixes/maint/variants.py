"""Per-baseline variants: context-only copies of the canonical patch, or real backports.

A variant is *context-only* when it changes exactly the lines its canonical patch changes (only
the context and positions differ): then the tool owns it and `regen` rewrites it from the
canonical patch on the baseline's tree, so it cannot drift. Any other variant is a *backport*
and says so, with a reason, in the manifest's `backports` table of a baseline that uses it.
A PyPI-only variant may leave out the test sections (those trees have no tests/): only its
code is compared then.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .. import git
from ..errors import CheckFailed
from ..manifest import Baseline, Manifest, Patch
from ..series import (
    LEFT_OUT_TRAILER,
    NO_TESTS_OPTS,
    apply_series,
    fit,
    has_upstream_tests,
    patch_arg,
    patch_text,
)
from .vendor import refuse_symlinks, replace_all

CONTEXT_ONLY = "context-only"
BACKPORT = "backport"


def sections(text: str) -> list[tuple[str, str]]:
    """(path, section text) per `diff --git` section of a patch (b/ side)."""
    out: list[tuple[str, str]] = []
    start = text.find("diff --git ")
    if start < 0:
        return out
    for chunk in text[start:].split("\ndiff --git ")[0:]:
        body = chunk if chunk.startswith("diff --git ") else "diff --git " + chunk
        first = body.splitlines()[0]
        path = first.rpartition(" b/")[2]
        out.append((path, body.rstrip("\n") + "\n"))
    return out


def changed_lines(text: str, tests: bool) -> Counter:
    """The lines a patch removes and adds, per file (context, headers and positions left out)."""
    lines: Counter = Counter()
    for path, body in sections(text):
        if path.startswith("tests/") != tests:
            continue
        in_hunk = False
        for line in body.splitlines():
            if line.startswith("@@"):
                in_hunk = True
            elif in_hunk and line[:1] in "+-":
                lines[(path, line)] += 1
    return lines


def has_tests(text: str) -> bool:
    return any(path.startswith("tests/") for path, _ in sections(text))


@dataclass
class Variant:
    patch: str
    file: str  # relative to patches/
    baselines: list[str] = field(default_factory=list)
    kind: str = CONTEXT_ONLY
    differ: int = 0  # changed lines that differ from the canonical's
    code_only: bool = False  # carries no test sections (PyPI-only)
    reason: str = ""  # why it is a backport (the manifest's `backports`)

    def describe(self) -> str:
        if self.kind == CONTEXT_ONLY:
            text = "context-only"
        else:
            text = f"backport, {self.differ} changed line(s) differ from the canonical"
        if self.code_only:
            text += " (code only)"
        return text

    def as_json(self) -> dict:
        return {k: v for k, v in vars(self).items() if v not in ("", False)}


def compare(canonical: str, variant: str) -> tuple[int, bool]:
    """(changed lines that differ, code only) of a variant against its canonical patch."""
    code_only = has_tests(canonical) and not has_tests(variant)
    a, b = changed_lines(canonical, False), changed_lines(variant, False)
    differ = sum(((a - b) + (b - a)).values())
    if not code_only:
        ta, tb = changed_lines(canonical, True), changed_lines(variant, True)
        differ += sum(((ta - tb) + (tb - ta)).values())
    return differ, code_only


def variants(manifest: Manifest) -> list[Variant]:
    """Every variant file of the series (once, with the baselines that use it), classified."""
    found: dict[str, Variant] = {}
    for b in manifest.baselines.values():
        for p in manifest.patches:
            rel = b.variants.get(p.id)
            if rel is None or p.id in b.absent:
                continue
            v = found.setdefault(rel, Variant(patch=p.id, file=rel))
            v.baselines.append(b.name)
            v.reason = v.reason or b.backports.get(p.id, "")
    for v in found.values():
        canonical = manifest.root / manifest.patch(v.patch).file
        path = manifest.root / v.file
        if not canonical.is_file() or not path.is_file():
            continue
        v.differ, v.code_only = compare(patch_text(canonical), patch_text(path))
        v.kind = BACKPORT if v.differ else CONTEXT_ONLY
    return sorted(found.values(), key=lambda v: v.file)


def drifted(manifest: Manifest) -> list[str]:
    """Problems: a variant not declared a backport that is one, or a declared one that is not."""
    problems: list[str] = []
    for v in variants(manifest):
        where = ", ".join(v.baselines)
        if v.kind == BACKPORT and not v.reason:
            problems.append(
                f"patches/{v.file} ({where}) changes other lines than its canonical patch "
                f"({v.differ} differ): run `python -m mcore_fixes regen`, or, if it is a real "
                f'backport, say why in [baselines.<name>.backports] {v.patch} = "..."'
            )
        elif v.kind == CONTEXT_ONLY and v.reason:
            problems.append(
                f"patches/{v.file} ({where}) is declared a backport but changes exactly the "
                "canonical's lines: drop it from `backports` (regen owns it)"
            )
    return problems


def export_notes(manifest: Manifest, updated: list[str]) -> list[str]:
    """After export rewrote canonical patches: their variants that may need the same change."""
    notes: list[str] = []
    canonical = {p.file: p for p in manifest.patches}
    for rel in updated:
        p = canonical.get(rel)
        if p is None:
            continue
        for v in variants(manifest):
            if v.patch != p.id:
                continue
            where = ", ".join(v.baselines)
            if v.reason:
                notes.append(
                    f"  backport  patches/{v.file} ({where}) may need the same change by hand"
                )
            else:
                notes.append(
                    f"  regen     patches/{v.file} ({where}): context-only, run "
                    "`python -m mcore_fixes regen`"
                )
    return notes


def _without_tests(text: str) -> str:
    head = text[: text.find("diff --git ")]
    return head + "".join(body for path, body in sections(text) if not path.startswith("tests/"))


def _relocate(tree: Path, text: str) -> str:
    """Apply `text` to the work tree and index of `tree` exactly: `git apply -3` (context
    matched in full, else a three-way merge from the pre-image blobs the patch's `index` lines
    name, which the caller fetched into `tree`); never a fuzzy placement. Returns "" on
    success, else why not (the tree is reset)."""
    proc = git.run(tree, "apply", "-3", "-", check=False, input=text.encode())
    conflicted = git.out(tree, "diff", "--name-only", "--diff-filter=U")
    if proc.returncode == 0 and not conflicted:
        return ""
    git.run(tree, "reset", "-q", "--hard")
    git.run(tree, "clean", "-q", "-fdx")
    if conflicted:
        return f"the three-way merge conflicts in {', '.join(conflicted.splitlines())}"
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    return lines[0].removeprefix("error: ") if lines else "git apply -3 failed"


def _fit_opts(tree: Path, path: Path) -> tuple[str, ...]:
    """The options that apply `path` to `tree` as the series does (its left-out tests)."""
    if not has_upstream_tests(tree):
        return NO_TESTS_OPTS
    found = fit(tree, path)
    return found[0] if found is not None else ()


def regen_variant(
    manifest: Manifest, b: Baseline, p: Patch, tree: Path, canonical_tree: Path
) -> tuple[str, str, str | None]:
    """`b`'s variant of `p` rewritten from the canonical patch: (file, what happened, new text
    or None where nothing is to be written). The caller writes all variants or none.

    The canonical patch is relocated exactly onto the tree just before `p` (the baseline's
    pristine tree with the earlier patches applied): a three-way merge from the canonical's
    own pre-image blobs (fetched from `canonical_tree`, the canonical baseline's tree with the
    series applied), never GNU patch's fuzz, which can put a hunk far from where it belongs.
    Where it does not relocate exactly, it refuses (CheckFailed), unless the variant already
    changes exactly the canonical's lines (a hand-placed context-only variant: left as is).
    On a tree with upstream's tests whose test files do not merge, the code alone is
    relocated (the test sections are then left out, and `apply` says so).
    """
    rel = b.variants[p.id]
    target = manifest.root / rel
    canonical = patch_text(manifest.root / p.file)
    canon = manifest.baseline(manifest.canonical)
    ccell = next(c for c in apply_series(canonical_tree, manifest, canon) if c.patch == p.id)
    if ccell.state != "applies":
        return rel, f"not regenerated: {ccell.state} on {canon.name} ({ccell.detail})", None
    cells = apply_series(tree, manifest, b)
    cell = next(c for c in cells if c.patch == p.id)
    if not cell.base:
        return rel, f"not regenerated: {cell.state} on {b.name} ({cell.detail})", None
    git.run(tree, "fetch", "-q", "--no-tags", str(canonical_tree), ccell.commit)
    git.run(tree, "checkout", "-q", "-f", "--detach", cell.base)
    git.run(tree, "clean", "-q", "-fdx")
    text = canonical if has_upstream_tests(tree) else _without_tests(canonical)
    if git.run(tree, "apply", "--check", "-", check=False, input=text.encode()).returncode == 0:
        return rel, f"the canonical patch applies to {b.name} as is: drop this variant", None
    why = _relocate(tree, text)
    if why and has_tests(text) and not _relocate(tree, _without_tests(text)):
        why, text = "", _without_tests(text)  # code relocated; its tests stay left out
    if why:
        kept = patch_text(target) if target.is_file() else ""
        fits = kept and git.ok(
            tree, "apply", "--check", *_fit_opts(tree, target), patch_arg(target)
        )
        if fits and compare(text, kept)[0] == 0:
            # placed by hand where no merge can place it, and it applies: nothing has drifted
            return rel, f"unchanged (the canonical does not relocate exactly: {why})", None
        raise CheckFailed(
            f"patches/{rel}: the canonical patch does not relocate exactly onto {b.name} "
            f"({why}): it is a backport; edit it by hand and declare it in "
            f"[baselines.{b.name}.backports]"
        )
    diff = git.run(tree, "diff", "--cached", "--binary", "--full-index", cell.base).stdout
    git.run(tree, "reset", "-q", "--hard")
    git.run(tree, "clean", "-q", "-fdx")
    mbox = text[: text.find("diff --git ")] + diff
    with tempfile.NamedTemporaryFile("w", suffix=".patch", delete=False) as f:
        f.write(mbox)
    try:
        git.run(tree, "am", "-q", "--keep-cr", f.name, env=git.TOOL_IDENTITY)
    finally:
        Path(f.name).unlink()
    new = git.run(tree, "format-patch", "-1", "HEAD", *git.FORMAT_PATCH_ARGS).stdout
    differ, _ = compare(text, new)
    if differ:
        raise CheckFailed(f"patches/{rel}: relocating the canonical patch changed {differ} lines")
    old = patch_text(target) if target.is_file() else ""
    if old == new:
        return rel, "unchanged", None
    return rel, "regenerated", new


def graft_tests(
    manifest: Manifest, b: Baseline, p: Patch, tree: Path, donor: Baseline, donor_tree: Path
) -> tuple[str, str]:
    """Land `p`'s test sections, as `donor` carries them, in `b`'s variant of `p`.

    For a git baseline whose test files differ from the ones the sections were written against
    (a release tag): each test file's change on `donor`'s tree (the canonical baseline, or a
    nearer tag) is merged three-way onto `b`'s tree (`git apply -3`, with the donor's blobs
    fetched into `b`'s tree repository), after the variant's code. A test file that does not
    merge cleanly stays left out (and `apply` says so). Returns (variant file, what happened);
    a new variant file is named `b/<canonical file name>`.
    """
    rel = b.variants.get(p.id, f"{b.name}/{Path(p.file).name}")
    cell = next(c for c in apply_series(tree, manifest, b) if c.patch == p.id)
    if cell.state != "applies" or not cell.excluded:
        return rel, f"unchanged ({cell.state}{', its tests land' if cell.commit else ''})"
    dcell = next(c for c in apply_series(donor_tree, manifest, donor) if c.patch == p.id)
    if dcell.state != "applies" or dcell.excluded:
        return rel, f"not grafted: its tests do not land on {donor.name} either"
    git.run(tree, "fetch", "-q", "--no-tags", str(donor_tree), dcell.commit)
    git.run(tree, "checkout", "-q", "-f", "--detach", cell.commit)
    landed, failed = [], []
    for test in cell.excluded:
        diff = git.run(
            tree, "diff", "--full-index", "--binary", f"{dcell.commit}^", dcell.commit, "--", test
        ).stdout
        if not diff:
            failed.append(f"{test} (not changed on {donor.name})")
            continue
        proc = git.run(tree, "apply", "-3", "-", check=False, input=diff.encode())
        if proc.returncode != 0 or git.out(tree, "ls-files", "-u"):
            git.run(tree, "reset", "-q", "--hard")
            git.run(tree, "clean", "-q", "-fdx")
            failed.append(f"{test} (does not merge onto {b.name}'s file)")
            continue
        git.run(tree, "commit", "-q", "--amend", "--no-edit", "--no-verify", env=git.TOOL_IDENTITY)
        landed.append(test)
    if not landed:
        return rel, f"not grafted: {'; '.join(failed)}"
    # The test files still left out are named in the message, so that `apply` says so.
    message = git.out(tree, "log", "-1", "--format=%B")
    kept = "\n".join(ln for ln in message.splitlines() if not ln.startswith(LEFT_OUT_TRAILER))
    trailers = "".join(f"\n{LEFT_OUT_TRAILER}{f}" for f in failed)
    if kept + trailers != message:
        git.run(
            tree, "commit", "-q", "--amend", "--no-verify", "-m", kept + trailers,
            env=git.TOOL_IDENTITY,
        )  # fmt: skip
    new = git.run(tree, "format-patch", "-1", "HEAD", *git.FORMAT_PATCH_ARGS).stdout
    target = manifest.root / rel
    refuse_symlinks(target, manifest.root)  # before a folder is made
    target.parent.mkdir(parents=True, exist_ok=True)
    replace_all({target: new}, within=manifest.root)
    what = f"tests landed: {', '.join(landed)}"
    return rel, what + (f"; left out: {'; '.join(failed)}" if failed else "")
