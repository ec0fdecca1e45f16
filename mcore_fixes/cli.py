"""Command line: `python -m mcore_fixes VERB`; `--help` lists the verbs."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from . import checkout, git, installed, sources
from . import manifest as manifest_mod
from .errors import CheckFailed, UserError
from .installed import INFO_NAME, fix_name
from .maint import affected, lint, report, variants
from .maint.prove import Runs, Servers, attach_proofs, prove_baseline
from .maint.pytests import pytest_command
from .maint.vendor import (
    export,
    refuse_symlinks,
    replace_all,
    series_hashes,
    vendor,
    vendored_baseline,
    verify_vendored,
)
from .manifest import Baseline, Manifest
from .progress import Progress
from .series import (
    OK_STATES,
    SKIPPED,
    Cell,
    apply_series,
    left_out_lines,
    read_patch,
    test_files,
)

if TYPE_CHECKING:  # numpy, which `audit` needs, is imported for that verb only
    from . import audit

CLONE_ROOT = Path(__file__).resolve().parent.parent
# `pip install <clone>` ships patches/ (manifest and patch files) inside the package (setup.py)
PACKAGED_SERIES = Path(__file__).resolve().parent / "patches"
# verbs that read or write a clone of this project (./megatron, patches/, tests/proofs, build/)
CLONE_ONLY = (
    "vendor",
    "export",
    "regen",
    "graft-tests",
    "prove",
    "lint-patches",
    "suites",
    "upstream",
    "docs",
)


def locate(args: argparse.Namespace) -> None:
    """Set args.root (the project: its build/ holds the pristine trees) and args.series (the
    patches/ folder): the clone this tool runs from, or `--root`; for an installed tool, the
    series it carries and a work folder in the download cache. Runs from any directory."""
    if args.root is None and (CLONE_ROOT / "patches" / "manifest.toml").is_file():
        args.root = CLONE_ROOT
    if args.root is not None:
        args.series = args.root / "patches"
        return
    if args.verb in CLONE_ONLY:
        raise UserError(
            f"`{args.verb}` works on a clone of mcore-fixes (its patches/, ./megatron and "
            f"tests): run `python -m mcore_fixes {args.verb}` from the clone's root folder"
        )
    if not (PACKAGED_SERIES / "manifest.toml").is_file():
        raise UserError(
            f"this mcore_fixes ({PACKAGED_SERIES.parent}) carries no series: reinstall it "
            "(`pip install --no-deps <clone>`) or run `python -m mcore_fixes` from the clone's root"
        )
    args.series = PACKAGED_SERIES
    args.root = sources.cache_dir() / "work"
    if args.verb not in ("apply", "unapply"):  # they work in the checkout's git dir only
        args.root.mkdir(parents=True, exist_ok=True)


def _manifest(args: argparse.Namespace) -> Manifest:
    return manifest_mod.load(args.series / "manifest.toml")


def _trees(args: argparse.Namespace) -> Path:
    return args.root / "build" / "trees"


def _selected(m: Manifest, names: list[str] | None) -> list[Baseline]:
    return [m.baseline(n) for n in names] if names else list(m.baselines.values())


def _pristine(args: argparse.Namespace, b: Baseline, progress: Progress) -> Path:
    return sources.pristine_tree(
        b, _trees(args), sources.mcore_repo_from(args.mcore_repo), progress
    )


NO_CHECKOUT = "no Megatron-LM checkout (pass --mcore-repo PATH or set MCORE_REPO)"


def _tree_or_skip(args: argparse.Namespace, b: Baseline, progress: Progress) -> Path | str:
    """The pristine tree of `b`, or why it cannot be had (a git baseline without a checkout).

    A git baseline already materialized under build/trees (pinned commit) needs no checkout.
    """
    mcore_repo = sources.mcore_repo_from(args.mcore_repo)
    if b.is_git and mcore_repo is None and not sources.cached(b, _trees(args)):
        return NO_CHECKOUT
    return sources.pristine_tree(b, _trees(args), mcore_repo, progress)


def cmd_vendor(args: argparse.Namespace) -> int:
    m = _manifest(args)
    b = m.baseline(args.baseline or m.default)
    progress = Progress()
    tree = _pristine(args, b, progress)
    record = vendor(args.root, m, b, tree, args.force, progress, chosen=bool(args.baseline))
    print(f"vendored megatron-core {b.name} into {args.root / 'megatron'}")
    if not b.installs_on(sys.version_info[:2]):
        print(
            f"  note: a fork of {b.name} installs only on Python >= {b.python} (this is "
            f"{sys.version_info[0]}.{sys.version_info[1]}); its tree still serves tests here"
        )
    for entry in record["applied"]:
        print(f"  applied   {entry['id']} ({fix_name(entry)})")
        for line in left_out_lines(entry["id"], entry.get("left_out", {})):
            print(f"            {line}")
    for entry in record["not_applied"]:
        print(f"  {entry['state']:<9} {entry['id']} ({fix_name(entry)}): {entry['reason']}")
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    m = _manifest(args)
    top = checkout.toplevel(Path(args.checkout).resolve())
    if args.baseline:
        b, why = m.baseline(args.baseline), "chosen with --baseline"
        checkout.check_override(m, top, b)
    else:
        b, why = checkout.detect_baseline(m, top)
    print(f"{top}: baseline {b.name} ({why})")
    before = git.out(top, "rev-parse", "HEAD")
    outcome = checkout.apply(m, top, b, commit=not args.no_commit, dry_run=args.dry_run)
    print(_by_fix(m, outcome.report), end="")
    done = ("already applied", "already in ", "absent", "fixed upstream")
    if all(what.startswith(done) for _, what in outcome.report):
        print("nothing to do: the series is already applied")
        return 0
    detached = not git.ok(top, "symbolic-ref", "-q", "HEAD")
    if args.dry_run:
        print(f"dry run, nothing written: the series would change {len(outcome.touched)} file(s):")
        print("".join(f"  {path}\n" for path in outcome.touched), end="")
    elif args.no_commit:
        print(f"undo: python -m mcore_fixes unapply {top}")
    elif git.out(top, "rev-parse", "HEAD") != before:
        print(f"undo: python -m mcore_fixes unapply {top}   (HEAD was {before[:12]})")
    if detached and not args.no_commit:
        tag = git.run(top, "describe", "--tags", "--exact-match", before, check=False).stdout
        at = f" at {tag.strip()}" if tag.strip() else ""
        would = "would be" if args.dry_run else "are"
        print(
            f"HEAD is detached{at}: the commits {would} on no branch; to keep them on one: "
            f"git -C {top} switch -c BRANCH-NAME"
        )
    return 0


def _by_fix(m: Manifest, report: list[tuple[str, str]]) -> str:
    """`apply`'s report, its patches under the fix each belongs to (`moe-loss-scales:`,
    `upstream #5077:`), in series order; lines of no patch (a recovery) first, unindented."""
    ids = {p.id: p for p in m.patches}
    lines, group = [], None
    for patch_id, what in report:
        p = ids.get(patch_id)
        if p is None:
            lines.append(f"  {patch_id}: {what}")
            continue
        if m.fix_label(p) != group:
            group = m.fix_label(p)
            lines.append(f"  {group}:")
        lines.append(f"    {patch_id}: {what}")
    return "".join(f"{line}\n" for line in lines)


def cmd_unapply(args: argparse.Namespace) -> int:
    top = checkout.toplevel(Path(args.checkout).resolve())
    try:
        new, orig, recovered = checkout.unapply(top)
    except checkout.NothingToUndo as nothing:  # nothing committed: is the series staged?
        m = _manifest(args)
        try:
            b, _ = checkout.detect_baseline(m, top)
        except UserError:
            raise nothing from None
        if nothing.recovered:
            print(f"{top}: {nothing.recovered}")
        restored, recovered = checkout.unapply_staged(m, top, b)
        if recovered:
            print(f"{top}: {recovered}")
        if not restored:
            raise nothing from None
        print(
            f"{top}: the series was staged, not committed (`apply --no-commit`): "
            f"{len(restored)} file(s) back as HEAD has them, in the index and the work tree; "
            "every other change is kept:"
        )
        print("".join(f"  {path}\n" for path in restored), end="")
        print(f"  to apply the series again: python -m mcore_fixes apply {top}")
        return 0
    if recovered:
        print(f"{top}: {recovered}")
    if new:
        print(f"{top}: HEAD back at {orig[:12]}, where `apply` found it (it was {new[:12]})")
    print(f"  to apply the series again: python -m mcore_fixes apply {top}")
    return 0


def _status_cells(args: argparse.Namespace, m: Manifest, progress: Progress) -> list[Cell]:
    sources.mcore_repo_from(args.mcore_repo)  # a bad --mcore-repo is an error, not a skip
    cells: list[Cell] = []
    for b in _selected(m, args.baseline):
        try:
            tree = _tree_or_skip(args, b, progress)
        except UserError as exc:  # e.g. the package index is unreachable: say so in the cell
            tree = str(exc)
        if isinstance(tree, str):
            cells += [Cell(p.id, b.name, SKIPPED, detail=tree) for p in m.patches]
            continue
        progress.step(f"checking the series on {b.name}")
        row = apply_series(tree, m, b)
        attach_proofs(args.root, m, b, row)
        cells += row
    return cells


def cmd_status(args: argparse.Namespace) -> int:
    m = _manifest(args)
    cells = _status_cells(args, m, Progress())
    kinds = variants.variants(m)
    if args.json:
        print(report.as_json(m, cells, kinds))
    elif args.markdown:
        print(report.markdown(m, cells))
    else:
        print(report.table(m, cells))
        print(report.variants_text(kinds))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    m = _manifest(args)
    b = m.baseline(vendored_baseline(args.root))
    tree = _pristine(args, b, Progress())
    results = export(args.root, m, b, tree, args.into)
    for path, what in results:
        print(f"  {what:<9} patches/{path}")
    for line in variants.export_notes(m, [p for p, what in results if what == "updated"]):
        print(line)
    return 0


def cmd_regen(args: argparse.Namespace) -> int:
    """Rewrite every context-only variant from its canonical patch (see variants.py).

    Every patch file involved must be present and parse first; the variant files are then
    written together, or, if one fails, none of them.
    """
    m = _manifest(args)
    progress = Progress()
    for b in m.baselines.values():
        series_hashes(m, b)
    if (args.root / "build" / "vendor.json").exists() and (args.root / "megatron").exists():
        # its edits must stay exportable: refuse unless it is its recorded baseline + series
        vendored = m.baseline(vendored_baseline(args.root))
        tree = _pristine(args, vendored, progress)
        apply_series(tree, m, vendored)
        verify_vendored(args.root, m, vendored, tree)
    canon = m.baseline(m.canonical)
    canonical_tree = _tree_or_skip(args, canon, progress)
    failed = 0
    new: dict[Path, str] = {}
    for v in variants.variants(m):
        if v.reason or (args.patch and v.patch not in args.patch):
            continue  # a declared backport is written by hand
        trees = {n: _tree_or_skip(args, m.baseline(n), progress) for n in v.baselines}
        usable = [n for n, t in trees.items() if not isinstance(t, str)]
        lacking = [n for n in v.baselines if n not in usable and m.baseline(n).is_git]
        if isinstance(canonical_tree, str):
            lacking = [canon.name]
        if lacking or not usable:
            print(f"  skipped   patches/{v.file}: {', '.join(lacking)} uses it: {NO_CHECKOUT}")
            continue
        # A git baseline's tree has upstream's tests: the variant keeps its test sections.
        name = sorted(usable, key=lambda n: not m.baseline(n).is_git)[0]
        progress.step(f"regenerating patches/{v.file} on {name}")
        b, tree = m.baseline(name), trees[name]
        try:
            path, what, text = variants.regen_variant(m, b, m.patch(v.patch), tree, canonical_tree)
        except CheckFailed as exc:
            print(f"  failed    {exc}")
            failed += 1
            continue
        if text is not None:
            new[m.root / path] = text
        print(f"  {what:<9} patches/{path}" if " " not in what else f"  patches/{path}: {what}")
    if failed:
        if new:
            print(f"  nothing written: {failed} variant(s) failed (the others stay as they were)")
        return 1
    for target in new:
        refuse_symlinks(target, m.root)  # before a folder is made
        target.parent.mkdir(parents=True, exist_ok=True)
    replace_all(new, within=m.root)
    return 0


def cmd_graft_tests(args: argparse.Namespace) -> int:
    """Land the patches' test sections on a release tag's test files (see variants.py)."""
    m = _manifest(args)
    progress = Progress()
    b = m.baseline(args.baseline)
    donors = [m.baseline(n) for n in (args.tests_from or [m.canonical])]
    if not all(x.is_git for x in (b, *donors)):
        raise UserError("graft-tests needs git baselines (their trees carry upstream's tests)")
    tree = _pristine(args, b, progress)
    trees = {d.name: _pristine(args, d, progress) for d in donors}
    added: dict[str, str] = {}
    for p in m.patches:
        if p.id in b.absent or (args.patch and p.id not in args.patch):
            continue
        for donor in donors:  # the first donor whose test change merges wins, per test file
            progress.step(f"grafting the tests of {p.id} onto {b.name} from {donor.name}")
            rel, what = variants.graft_tests(m, b, p, tree, donor, trees[donor.name])
            print(f"  patches/{rel} (from {donor.name}): {what}")
            if what.startswith("tests landed") and p.id not in b.variants:
                b = dataclasses.replace(b, variants={**b.variants, p.id: rel})
                m.baselines[b.name] = b  # the later patches apply on top of it
                added[p.id] = rel
    if added:
        print(f'new variants: add to [baselines."{b.name}".variants] in patches/manifest.toml:')
        for patch_id, rel in added.items():
            print(f'  {patch_id} = "{rel}"')
    return 0


def cmd_prove(args: argparse.Namespace) -> int:
    m = _manifest(args)
    progress = Progress()
    for patch_id in args.patch or []:
        m.patch(patch_id)
    runs = Runs()

    def one(b: Baseline) -> list[Cell]:
        tree = _tree_or_skip(args, b, progress)
        if isinstance(tree, str):
            print(f"baseline {b.name} skipped: {tree}", file=sys.stderr)
            return [Cell(p.id, b.name, SKIPPED, detail=tree) for p in m.patches]
        return prove_baseline(
            args.root, m, b, tree, args.python, args.patch, progress, runs, args.changed,
            alone=args.alone, servers=servers,
        )  # fmt: skip

    # Baselines are independent trees: --jobs of them at once (sdists are fetched first).
    selected = _selected(m, args.baseline)
    for b in selected:
        _tree_or_skip(args, b, progress)
    # Longest first (more patches, more tree states), so that no job is left alone at the end.
    order = sorted(selected, key=lambda b: -sum(p.id not in b.absent for p in m.patches))
    with (
        Servers(args.python, runs) as servers,
        concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool,
    ):
        rows = dict(zip([b.name for b in order], pool.map(one, order), strict=True))
    cells = [c for b in selected for c in rows[b.name]]
    print(runs.summary(), file=sys.stderr)
    if args.timing:
        Path(args.timing).write_text(json.dumps(runs.as_json(), indent=1) + "\n")
    print(report.markdown(m, cells) if args.markdown else report.table(m, cells))
    # the last: a conflict, said so
    fine = ("proven", "fixed-upstream", "applied-upstream", "fails-unpatched")
    bad = [c for c in cells if c.proof and c.proof.get("verdict") not in fine]
    return 1 if bad else 0


def cmd_test(args: argparse.Namespace) -> int:
    m = _manifest(args)
    b = m.baseline(args.baseline or m.default)
    progress = Progress()
    tree = _tree_or_skip(args, b, progress)
    if isinstance(tree, str):
        print(f"baseline {b.name} skipped: {tree}")
        return 0
    cells = apply_series(tree, m, b)
    bad = [c for c in cells if c.state not in (*OK_STATES, "absent")]
    if bad:
        raise CheckFailed(f"the series does not apply to {b.name}: {bad[0].patch}: {bad[0].detail}")
    files = [
        t for c in cells if c.state == "applies" for t in test_files(read_patch(m.root / c.file))
    ]
    cmd = pytest_command(sys.executable, files + args.pytest_args)
    progress.step(f"running {len(files)} test file(s) on the patched {b.name} tree")
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(cmd, cwd=tree, env=env).returncode


def cmd_lint_patches(args: argparse.Namespace) -> int:
    """Each commit of the series, checked like upstream's CI (see mcore_fixes/maint/lint.py)."""
    m = _manifest(args)
    progress = Progress()
    return lint.lint_patches(
        args.root,
        m,
        _selected(m, args.baseline),
        lambda b: _tree_or_skip(args, b, progress),
        sources.mcore_repo_from(args.mcore_repo),
        args.tools_python,
        python_tests=args.python,
    )


def cmd_suites(args: argparse.Namespace) -> int:
    from .maint import suites  # noqa: PLC0415

    m = _manifest(args)
    source = Path(args.checkout).resolve()
    if args.baseline:
        b = m.baseline(args.baseline)
    elif source.is_dir():
        b, _ = checkout.detect_baseline(m, checkout.toplevel(source))
    else:
        b = m.baseline(m.canonical)
    out = Path(args.out or args.root / "build" / "suites" / f"{b.name}-results").resolve()
    extra = shlex.split(args.pytest_args)
    homes = tuple(args.suite) if args.suite else suites.SUITES
    return suites.run_suites(
        args.root, m, b, source, out, args.nproc, args.python, extra, args.timeout, homes=homes
    )


def cmd_upstream(args: argparse.Namespace) -> int:
    from .maint import upstream  # noqa: PLC0415

    repo = sources.mcore_repo_from(args.mcore_repo)
    if repo is None:
        raise UserError("upstream needs a Megatron-LM checkout: pass --mcore-repo PATH")
    upstream.export(args.root, _manifest(args), repo, args.onto, args.fix)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    found = installed.imported()
    record = found.record
    dist = found.dist
    data: dict = {
        "fork": record is not None,
        "location": str(found.location),
        "distribution": dist.version if dist else None,
        "installed_in": str(dist.locate_file("")) if dist else None,
        "shadows": installed.describe(found.shadowed) if found.shadowed else None,
    }
    # An installed fork must run: pip installs it without torch (never pulled for it) and,
    # with --no-deps, without psutil; a vendored tree in a clone is the maintainers' to run.
    missing = installed.missing_runtime(record) if record and dist else None
    if args.json:
        print(json.dumps((record or {}) | data | {"missing": missing}, indent=2))
        return 0 if record and not missing else 1
    if dist is not None:
        print(f"megatron.core at {found.location}")
        print(f"distribution {installed.describe(dist)}")
    else:  # e.g. run from a clone: its ./megatron is imported first
        other = installed.describe(found.shadowed) if found.shadowed else "no megatron-core"
        tree = "a tree vendored by `python -m mcore_fixes vendor`" if record else "a source tree"
        print(f"installed: {other}")
        print(
            f"here: megatron.core at {found.location}, {tree}, not installed: first on sys.path "
            "(e.g. the current folder), it is what Python imports here"
        )
    if record is None:
        print(f"not an mcore-fixes build: no {INFO_NAME} in {found.location}")
        return 1
    print(f"base: {record['baseline']} ({record['source']}, pin {record['pin']})")
    for entry in record["applied"]:
        print(f"  applied   {entry['id']} ({fix_name(entry)}; {entry['file']})")
    for entry in record["not_applied"]:
        print(f"  {entry['state']:<9} {entry['id']} ({fix_name(entry)}): {entry['reason']}")
    carried = [e for e in record["applied"] if e.get("upstream")]
    if carried:
        print(f"upstream's own fixes this fork adds to {record['baseline']} (not in this base):")
    for entry in carried:
        up = entry["upstream"]
        where = "open PR, not merged" if up["origin"] == "upstream-pr" else "merged on "
        where += ", ".join(up["branches"])
        print(f"  #{up['pr']} {entry['id']} ({where}): {up['url']}")
        if up.get("affects"):
            print(f"      affects: {up['affects']}")
    if missing:
        raise CheckFailed(f"the fork is installed but cannot run here: {missing}")
    return 0


def cmd_docs(args: argparse.Namespace) -> int:
    """The generated docs: README's "Am I affected?" table (from the manifest) and
    docs/evidence.md (from the stored proofs and docs/gpu/). The evidence page is written only
    where every baseline's tree is at hand (git baselines: a checkout, or build/trees)."""
    from .maint import evidence  # noqa: PLC0415

    m = _manifest(args)
    readme = args.root / "README.md"
    pages = {
        readme: affected.replace_block(readme.read_text(encoding="utf-8"), affected.markdown(m))
    }
    args.baseline = None
    cells = _status_cells(args, m, Progress())
    skipped = sorted({c.baseline for c in cells if c.state == SKIPPED})
    page = args.root / "docs" / "evidence.md"
    if skipped:
        print(f"docs/evidence.md: not written: {', '.join(skipped)}: {NO_CHECKOUT}")
    else:
        pages[page] = evidence.markdown(m, cells, args.root / "docs")
    stale = [p for p, text in pages.items() if not p.exists() or p.read_text("utf-8") != text]
    for path in pages:
        rel = path.relative_to(args.root).as_posix()
        print(f"{rel}: {'differs from its sources' if path in stale else 'up to date'}")
    if args.check:
        if stale:
            print("run `python -m mcore_fixes docs` to write them")
        return 1 if stale else 0
    for path in stale:
        refuse_symlinks(path, args.root)  # before a folder is made
        path.parent.mkdir(parents=True, exist_ok=True)
    replace_all({p: pages[p] for p in stale}, within=args.root)
    if stale:
        print(f"written: {', '.join(p.relative_to(args.root).as_posix() for p in stale)}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """Whether a checkpoint carries the damage of the series' bugs (see mcore_fixes/audit/)."""
    try:
        report = _audit_report(Path(args.checkpoint))
    except (UserError, OSError) as exc:  # --json: JSON still, with the one line (on stderr)
        if args.json:
            print(json.dumps({"checkpoint": args.checkpoint, "error": str(exc)}, indent=1))
        raise
    if args.json:
        print(json.dumps(report.as_json(), indent=1, allow_nan=False))
    else:
        encoding = sys.stdout.encoding or "utf-8"
        for line in report.text():  # names from the files may not be encodable here
            print(line.encode(encoding, "backslashreplace").decode(encoding))
    return report.exit_code


def _audit_report(path: Path) -> audit.Report:
    try:
        from . import audit  # noqa: PLC0415 - numpy is imported for this verb only
    except ImportError as exc:
        if exc.name != "numpy":
            raise
        raise UserError(
            "audit reads checkpoints with numpy: install it (pip install numpy)"
        ) from None
    return audit.audit(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mcore_fixes", description=__doc__)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="verb", required=True)

    def with_repo(p: argparse.ArgumentParser, use: str = "read only, never modified") -> None:
        p.add_argument(
            "--mcore-repo",
            help=f"Megatron-LM git checkout for git baselines (default: $MCORE_REPO); {use}",
        )

    p = sub.add_parser("vendor", help="materialize a baseline, apply the series -> ./megatron")
    p.add_argument("--baseline", help="baseline name (default: the manifest's default)")
    p.add_argument("--force", action="store_true", help="discard local edits of ./megatron")
    with_repo(p)
    p.set_defaults(func=cmd_vendor)

    p = sub.add_parser("apply", help="apply the series to a Megatron-LM checkout")
    p.add_argument("checkout", help="path of the checkout (a clone or a linked worktree)")
    p.add_argument("--baseline", help="override baseline detection")
    p.add_argument("--no-commit", action="store_true", help="leave changes in the work tree")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="say what would change (baseline, patch files, left-out tests, files); write nothing",
    )
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser(
        "unapply",
        help="undo the last apply: HEAD back to where it found it (uncommitted work stays)",
    )
    p.add_argument("checkout", help="path of the checkout apply changed")
    p.set_defaults(func=cmd_unapply)

    p = sub.add_parser("status", help="patch x baseline matrix")
    p.add_argument("--baseline", action="append", help="limit to these baselines (repeatable)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--markdown", action="store_true")
    with_repo(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("export", help="regenerate patch files from edits of ./megatron")
    p.add_argument("--into", help="patch id that receives edits to files no patch touches")
    p.add_argument("--mcore-repo", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("regen", help="rewrite the context-only variants from the canonical patch")
    p.add_argument("--patch", action="append", help="limit to these patch ids (repeatable)")
    with_repo(p)
    p.set_defaults(func=cmd_regen)

    p = sub.add_parser("graft-tests", help="land the series' tests on a release tag's tests/")
    p.add_argument("--baseline", required=True, help="the git baseline whose variants to write")
    p.add_argument(
        "--from",
        dest="tests_from",
        action="append",
        help="donor git baseline, repeatable, in order of preference (default: the canonical)",
    )
    p.add_argument("--patch", action="append", help="limit to these patch ids (repeatable)")
    with_repo(p)
    p.set_defaults(func=cmd_graft_tests)

    p = sub.add_parser("prove", help="fail-before / pass-after of each patch's tests")
    p.add_argument("--baseline", action="append", help="limit to these baselines (repeatable)")
    p.add_argument("--patch", action="append", help="limit to these patch ids (repeatable)")
    p.add_argument("--python", default=sys.executable, help="interpreter with torch + pytest")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("-j", "--jobs", type=int, default=1, help="baselines proven at once")
    p.add_argument(
        "--changed", action="store_true", help="keep stored proofs that still hold; prove the rest"
    )
    p.add_argument("--timing", help="write the pytest processes' timings (JSON) to this file")
    p.add_argument(
        "--alone",
        action="store_true",
        help="each commit stands alone: prove each patch on the baseline plus only its declared "
        "requires (stored apart, build/proofs/<baseline>.alone.json)",
    )
    with_repo(p)
    p.set_defaults(func=cmd_prove)

    p = sub.add_parser("test", help="run the series' regression tests on a patched baseline")
    p.add_argument("--baseline", help="baseline name (default: the manifest's default)")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    with_repo(p)
    p.set_defaults(func=cmd_test)

    p = sub.add_parser("lint-patches", help="upstream's CI checks on each commit of the series")
    p.add_argument("--baseline", action="append", help="limit to these baselines (repeatable)")
    p.add_argument(
        "--tools-python",
        help="interpreter with upstream's pinned black/isort/pylint and griffe "
        "(default: a venv the tool makes under build/lint-env)",
    )
    p.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter with torch + pytest: each patch's tests collected on the baseline plus "
        "its requires (skipped, said so, where it lacks them)",
    )
    with_repo(p)
    p.set_defaults(func=cmd_lint_patches)

    p = sub.add_parser("upstream", help="one branch per upstream PR in a checkout (never pushes)")
    p.add_argument("--fix", type=int, action="append", help="only this fix (repeatable)")
    p.add_argument(
        "--onto",
        action="append",
        help="base commit or branch, repeatable (default: the pinned commits of main and dev, "
        "for the [Main] and [Dev] PRs)",
    )
    with_repo(
        p,
        "gets the branches mcore-fixes/fix-N and mcore-fixes/dev/fix-N (and their "
        "descriptions); its work tree, index and HEAD are not touched",
    )
    p.set_defaults(func=cmd_upstream)

    p = sub.add_parser("suites", help="upstream's neighbouring suites, pristine vs patched (GPU)")
    p.add_argument("checkout", help="a full Megatron-LM checkout (work tree or tarball of one)")
    p.add_argument("--baseline", help="baseline of the checkout (default: detected)")
    p.add_argument("--nproc", type=int, default=1, help="torchrun --nproc_per_node (GPUs)")
    p.add_argument("--out", help="folder for junit files, logs and report.md")
    p.add_argument("--python", default=sys.executable, help="interpreter with torch + pytest")
    p.add_argument("--timeout", type=int, default=1800, help="seconds for all runs together")
    p.add_argument("--suite", action="append", help="test path (repeatable; default: the homes)")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    p.set_defaults(func=cmd_suites)

    p = sub.add_parser(
        "docs", help="write the generated docs: README's bug table, docs/evidence.md"
    )
    p.add_argument("--check", action="store_true", help="only say whether they are up to date")
    with_repo(p)
    p.set_defaults(func=cmd_docs)

    p = sub.add_parser("audit", help="does a checkpoint carry the damage of these bugs? (CPU)")
    p.add_argument(
        "checkpoint",
        help="a checkpoint directory (torch_dist or torch format), or "
        "the save directory (its latest checkpoint)",
    )
    p.add_argument(
        "--json", action="store_true", help="every check with its evidence and what loading does"
    )
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser(
        "info", help="which megatron-core Python imports here (the fork or not) and its patches"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.verb in ("info", "audit"):  # what Python imports, a checkpoint: no project, no git
            return args.func(args)
        git.git_exe()  # every other verb needs git: say so before doing anything
        locate(args)
        if args.verb in ("apply", "unapply"):
            return args.func(args)
        with sources.project_lock(args.root, Progress()):
            return args.func(args)
    except UserError as exc:
        print(f"mcore_fixes: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # what was written is completed or undone (apply: next run)
        print("mcore_fixes: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `status | head`
        sys.stderr.close()
        return 0
    except OSError as exc:  # permission denied, disk full, read-only file system, ...
        print(f"mcore_fixes: error: {exc}", file=sys.stderr)
        return 2
