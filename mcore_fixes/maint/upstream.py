"""`upstream`: branches of upstream PRs in the user's Megatron-LM checkout, ready to send.

Upstream pairs a fix's PRs per branch: a [Main] PR and its [Dev] twin. For each target (by
default the pinned commits of main and of dev, where the checkout has them; `--onto REF` for
others) and each fix of the series, a branch ``mcore-fixes/fix-N`` (on the canonical baseline;
``mcore-fixes/<baseline>/fix-N`` on another, e.g. ``mcore-fixes/dev/fix-2``) with one commit
per change. The target's baseline is detected as `apply` does, and its patch files (variants)
and states (fixed-upstream, already applied) are the ones `apply` uses there. A fix whose
patches require another fix's patches (fix 1 on fix 4) is built on that fix's branch: the
existing branch where it is current (made by the tool from the same inputs), else a fresh
build of it, said so.

Upstream's own commits (`upstream-commit` in the manifest), one rule on every target: one that
the target already contains is left out (with the patches standing for it); one it lacks is
`git cherry-pick -x`'d from the checkout (author and sign-off kept, the runner's added;
import-only conflicts merged as isort writes them), else the series' patch for that baseline
is used, said so. A patch that is upstream's own fix carried by the series (a DEP-3
``Origin:`` in its message, or manifest ``origin``) gets a branch of its own,
``cherry-pick-<PR>``, on each target that lacks the commit: the [Dev] (or [Main]) twin of what
the other branch has, the series' backport standing in (upstream's author and message kept)
where the cherry-pick conflicts; none for an open PR's commit (on no branch of the checkout).

Our commits are authored, committed and signed off (DCO ``Signed-off-by:``) by the git
identity of the person running the tool (refused when none is configured); the project's
trailers (DEP-3 ``Bug``/``Forwarded``/``Applied-Upstream``/``Origin``, ``Proven-on``) and any
``Signed-off-by`` of the patch file leave the message. The PR description (title first,
``[Main]``/``[Dev]``; upstream's pull-request template filled in; linked issue; tests;
baselines; then ``patches/pr/fix-N.md`` and ``patches/pr/<patch-id>.md`` where they exist) goes
into ``branch.<name>.description`` and build/upstream/<branch>.md.

Everything is built in a scratch clone (hooks off, no global or system git config) that shares
the checkout's objects and is removed on exit, Ctrl-C, SIGTERM and SIGHUP (one left by a
killed run is removed by the next). The checkout then gets the new objects, the records
(``branch.<name>.mcoreFixes`` = tip, ``...Inputs``) and, in one ``git update-ref``
transaction, all branches or none; its work tree, index and HEAD are never touched. A branch
the tool did not make (no record, or a tip other than the recorded one), one checked out in a
work tree, or a ref name taken by a folder of branches is refused before anything is written.
Nothing is pushed.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .. import git
from ..checkout import detect_baseline
from ..errors import CheckFailed, UserError
from ..manifest import Baseline, Manifest, Patch
from ..series import APPLIES, OK_STATES, Cell, apply_series, file_sha256, read_patch, test_files

BRANCH_PREFIX = "mcore-fixes/"
RECORD_KEY = "mcoreFixes"  # branch.<name>.mcoreFixes = tip the tool made
INPUTS_KEY = "mcoreFixesInputs"  # ... = what it was made from (a hash): current or not
PREVIOUS_KEY = "mcoreFixesPrevious"  # ... = the tip being replaced, while the refs move
INPUTS_FORMAT = "2"  # bump when the same inputs would make other commits
UPSTREAM_BRANCHES = ("main", "dev")  # baselines that are upstream's branches: PR targets
SCRATCH_PREFIX = "mcore-fixes-upstream-"
SCRATCH_MARKER = "mcore-fixes-upstream.pid"  # "<pid> <host>" of the run that owns the dir
PROJECT_TRAILERS = (
    "Bug",
    "Forwarded",
    "Applied-Upstream",
    "Proven-on",
    "Last-Update",
    "Origin",
    "Left-out-test",
    "Signed-off-by",  # the sender signs off; a patch file carries none (the bot's once)
)
TEMPLATE_PATHS = (
    ".github/PULL_REQUEST_TEMPLATE.md",
    ".github/pull_request_template.md",
    "PULL_REQUEST_TEMPLATE.md",
    "pull_request_template.md",
    "docs/pull_request_template.md",
)
DEFAULT_TEMPLATE = "# What does this PR do?\n<!-- Add a one line overview -->\n\nLinked issue:\n"
_TRAILER = re.compile(r"^([A-Za-z][A-Za-z0-9-]*): (.*)$")
_ISSUE_URL = re.compile(r"https://github\.com/NVIDIA/Megatron-LM/(issues|pull)/(\d+)")
_OTHER_GH = re.compile(r"https://github\.com/([\w.-]+/[\w.-]+)/(issues|pull)/(\d+)")
_PR_NUMBER = re.compile(r"\(#(\d+)\)\s*$")  # a squash-merged subject: "Fix things (#5077)"


@dataclass
class Identity:
    name: str
    email: str

    @property
    def env(self) -> dict[str, str]:
        return {
            "GIT_AUTHOR_NAME": self.name,
            "GIT_AUTHOR_EMAIL": self.email,
            "GIT_COMMITTER_NAME": self.name,
            "GIT_COMMITTER_EMAIL": self.email,
        }

    @property
    def signoff(self) -> str:
        return f"Signed-off-by: {self.name} <{self.email}>"


@dataclass
class Message:
    subject: str
    body: str  # without trailers
    trailers: list[tuple[str, str]] = field(default_factory=list)


def identity(checkout: Path) -> Identity:
    """The runner's git identity (user.name/user.email of the checkout, or GIT_AUTHOR_*)."""
    name = os.environ.get("GIT_AUTHOR_NAME") or _config(checkout, "user.name")
    email = os.environ.get("GIT_AUTHOR_EMAIL") or _config(checkout, "user.email")
    if not name or not email:
        raise UserError(
            f"no git identity is configured for {checkout}: upstream accepts only commits "
            "signed off (DCO) by their real author. Set yours first:\n"
            '    git config --global user.name "Your Name"\n'
            "    git config --global user.email you@example.com"
        )
    if email == git.TOOL_IDENTITY["GIT_AUTHOR_EMAIL"]:
        raise UserError(f"{email} is the tool's own identity, not a person's: set yours")
    return Identity(name, email)


def _config(repo: Path, key: str) -> str:
    proc = git.run(repo, "config", "--get", key, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def parse_message(patch_text: str) -> Message:
    """Subject, body and trailers of a `git format-patch` file."""
    header, _, rest = patch_text.partition("\n\n")
    subject_lines: list[str] = []
    in_subject = False
    for line in header.splitlines():
        if line.startswith("Subject: "):
            in_subject = True
            subject_lines.append(line[len("Subject: ") :])
        elif in_subject and line.startswith((" ", "\t")):
            subject_lines.append(line.strip())
        else:
            in_subject = False
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", " ".join(subject_lines))
    body = rest.split("\n---\n", 1)[0].rstrip("\n")
    paragraphs = body.split("\n\n")
    trailers: list[tuple[str, str]] = []
    last = paragraphs[-1].splitlines() if paragraphs else []
    if last and all(_TRAILER.match(line) for line in last):
        trailers = [_TRAILER.match(line).groups() for line in last]  # type: ignore[union-attr]
        paragraphs = paragraphs[:-1]
    return Message(subject, "\n\n".join(paragraphs).strip("\n"), trailers)


def upstream_message(msg: Message, who: Identity) -> str:
    """The commit message upstream gets: our trailers and sign-offs out, the runner's in."""
    lines = [f"{k}: {v}" for k, v in msg.trailers if k not in PROJECT_TRAILERS]
    lines.append(who.signoff)
    body = f"\n\n{msg.body}" if msg.body else ""
    return f"{msg.subject}{body}\n\n" + "\n".join(lines) + "\n"


def linked_issues(messages: list[Message]) -> list[str]:
    """`Fixes #N` for upstream issues, `Related to #N` / `Related to owner/repo#N` otherwise."""
    refs: list[str] = []
    for msg in messages:
        for key, value in msg.trailers:
            if key != "Bug":
                continue
            for url in value.split():
                m = _ISSUE_URL.match(url)
                o = _OTHER_GH.match(url)
                if m:
                    ref = (
                        f"Fixes #{m.group(2)}"
                        if m.group(1) == "issues"
                        else f"Related to #{m.group(2)}"
                    )
                elif o:
                    ref = f"Related to {o.group(1)}#{o.group(3)}"
                else:
                    ref = f"Related to {url}"
                if ref not in refs:
                    refs.append(ref)
        for m in re.finditer(r"\b(?:Fixes|Closes|Resolves) #\d+", msg.body):
            if m.group(0) not in refs:
                refs.append(m.group(0))
    return refs


def _blob(repo: Path, spec: str) -> bytes | None:
    """The bytes of `spec` (`<commit>:<path>`), or None; bytes: a file need not be UTF-8."""
    proc = subprocess.run(
        [git.git_exe(), "-C", str(repo), "cat-file", "blob", spec],
        capture_output=True,
        env=git.environment(repo),
    )
    return proc.stdout if proc.returncode == 0 else None


def template(repo: Path, base: str, say: Callable[[str], None] = print) -> str:
    """Upstream's pull-request template at `base` (undecodable bytes replaced, said so)."""
    for rel in TEMPLATE_PATHS:
        data = _blob(repo, f"{base}:{rel}")
        if data is None:
            continue
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            say(f"{rel} at {base[:10]} is not UTF-8 (byte {exc.start}): read with U+FFFD for it")
            return data.decode("utf-8", errors="replace")
    return DEFAULT_TEMPLATE


def pr_texts(m: Manifest, names: list[str]) -> list[str]:
    """The evidence of patches/pr/<name> that exist (the fix's, its patches'), in order."""
    texts: list[str] = []
    for name in dict.fromkeys(names):
        path = m.root / "pr" / name
        if not path.exists() and not path.is_symlink():
            continue
        if path.is_symlink() or not path.is_file():
            raise UserError(f"{path}: a PR text must be a plain file in patches/pr/")
        try:
            texts.append(path.read_text(encoding="utf-8").strip("\n"))
        except UnicodeDecodeError as exc:
            raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except OSError as exc:
            raise UserError(f"{path}: cannot read it ({exc.strerror})") from None
    return [t for t in texts if t]


def pr_description(
    tmpl: str,
    fix: int,
    messages: list[Message],
    tests: list[str],
    baselines: list[str],
    depends: str | None,
    picked: str = "",
    evidence: list[str] | None = None,
    title: str = "",
) -> str:
    """Upstream's PR template, filled in: overview, linked issue, what was tested, where.

    `picked`: what the branch takes from upstream's own commits (cherry-picked), said first;
    `evidence`: texts of patches/pr/ appended to the overview; `title`: the first line (a
    ``Title:`` line of the first evidence text wins), e.g. "[Dev] Fix ...".
    """
    evidence = list(evidence or [])
    if evidence and evidence[0].startswith("Title: "):
        first, _, rest = evidence[0].partition("\n")
        prefix = re.match(r"^\[[^\]]+\] ", title)
        title = (prefix.group(0) if prefix else "") + first[len("Title: ") :].strip()
        evidence[0] = rest.strip("\n")
    parts = [
        messages[0].subject if len(messages) == 1 else f"Fix {fix}, in {len(messages)} commits"
    ]
    if picked:
        parts.append(picked)
    if depends:
        parts.append(f"Depends on the PR(s) of branch `{depends}` (their commits come first here).")
    if len(messages) > 1:
        listed = "\n".join(f"{i}. {m.subject}" for i, m in enumerate(messages, 1))
        parts.append(f"Commits (each applies, imports and passes its tests on its own):\n{listed}")
    # a message of trailers only (upstream's squash merges) has nothing to say past its subject
    parts += [f"### {m.subject}\n\n{m.body}" for m in messages if m.body]
    tested = "\n".join(f"- `{t}`" for t in tests) or "- (no test file)"
    where = ", ".join(baselines) or "(no proof recorded here: run `python -m mcore_fixes prove`)"
    parts.append(
        "### How it was tested\n\n"
        "Unit tests added or changed (upstream layout, `Utils`, real CUDA; run as "
        "`torchrun --nproc_per_node=8 -m pytest`; cases needing more ranks than the world "
        f"has skip):\n{tested}\n\n"
        "Fail-before / pass-after, with real MCore objects in gloo worlds on CPU "
        f"(mcore-fixes `prove`), on the baselines: {where}."
    )
    parts += [t for t in evidence if t]
    detail = "\n\n".join(parts) + "\n"
    issues = ", ".join(linked_issues(messages)) or "none"
    text = tmpl
    overview_comment = re.compile(r"<!-- Add a one line overview[^>]*-->")
    if overview_comment.search(text):
        text = overview_comment.sub(lambda _: detail.rstrip("\n"), text, count=1)
    else:
        text = f"{detail}\n{text}"
    linked = re.compile(r"^Linked issue:.*$", re.M)
    if linked.search(text):
        text = linked.sub(lambda _: f"Linked issue: {issues}", text, count=1)
    else:
        text += f"\nLinked issue: {issues}\n"
    if tests:
        text = text.replace(
            "- [ ] I have added relevant unit tests", "- [x] I have added relevant unit tests"
        )
    head = f"{title}\n\n" if title else ""
    return f"{head}<!-- mcore-fixes fix {fix}: draft PR description; review every line -->\n{text}"


# --- upstream's own commit, cherry-picked -----------------------------------------------------

_CONFLICT = re.compile(
    r"^<<<<<<< [^\n]*\n(?P<ours>.*?)(?:^\|\|\|\|\|\|\| [^\n]*\n.*?)?^=======\n(?P<theirs>.*?)"
    r"^>>>>>>> [^\n]*\n",
    re.S | re.M,
)
LINE_LENGTH = 100  # upstream's black and isort


def _name_key(alias: ast.alias) -> tuple[int, str]:
    # isort's order_by_type (profile black): CONSTANTS, Classes, functions
    name = alias.name
    kind = 0 if name.isupper() and len(name) > 1 else 1 if name[:1].isupper() else 2
    return kind, name


def _alias(a: ast.alias) -> str:
    return f"{a.name} as {a.asname}" if a.asname else a.name


def merge_imports(ours: str, theirs: str) -> str | None:
    """One side of a conflict each, both nothing but import statements: every import of both,
    one statement per module, sorted and wrapped as isort (profile black, line 100) writes
    them; None where either side holds anything else (then no text resolution is safe)."""
    try:
        sides = [ast.parse(ours), ast.parse(theirs)]
    except SyntaxError:
        return None
    plain: list[str] = []
    froms: dict[tuple[int, str], dict[str, ast.alias]] = {}
    for tree in sides:
        for node in tree.body:
            if isinstance(node, ast.Import):
                plain += [_alias(a) for a in node.names if _alias(a) not in plain]
            elif isinstance(node, ast.ImportFrom):
                names = froms.setdefault((node.level, node.module or ""), {})
                for a in node.names:
                    names.setdefault(_alias(a), a)
            else:
                return None
    lines = [f"import {name}" for name in sorted(plain, key=str.lower)]
    for (level, module), names in sorted(froms.items(), key=lambda kv: kv[0][1].lower()):
        listed = [_alias(a) for a in sorted(names.values(), key=_name_key)]
        head = f"from {'.' * level}{module} import "
        one = head + ", ".join(listed)
        if len(one) <= LINE_LENGTH:
            lines.append(one)
        else:
            lines.append(head + "(\n" + "".join(f"    {n},\n" for n in listed) + ")")
    lead = ours[: len(ours) - len(ours.lstrip("\n"))]
    trail = ours[len(ours.rstrip("\n")) + 1 :] if ours.strip() else ""
    return lead + "\n".join(lines) + "\n" + trail


def resolve_imports(text: str) -> str | None:
    """`text` with every conflict block resolved by `merge_imports`; None if one cannot be."""
    failed = False

    def one(m: re.Match[str]) -> str:
        nonlocal failed
        merged = merge_imports(m.group("ours"), m.group("theirs"))
        failed = failed or merged is None
        return merged or ""

    resolved = _CONFLICT.sub(one, text)
    if failed or "<<<<<<< " in resolved:
        return None
    return resolved


def _cherry_pick(
    scratch: Path, sha: str, env: dict[str, str], who: Identity, tmp: Path
) -> tuple[str, list[str]]:
    """`git cherry-pick -x` of upstream's `sha` onto HEAD, author and message kept, the runner's
    sign-off added; import-only conflicts resolved (both sides' imports, isort's layout) and
    listed in a "Conflicts:" note as upstream's cherry-picks do. ('', []) when made, else why
    not and the conflicted files (HEAD back where it was)."""
    head = git.out(scratch, "rev-parse", "HEAD")
    proc = git.run(scratch, "cherry-pick", "-x", "-s", sha, check=False, env=env)
    if proc.returncode == 0:
        return "", []
    conflicted = git.out(scratch, "diff", "--name-only", "--diff-filter=U").splitlines()
    resolved: dict[str, str] = {}
    why = ""
    for rel in conflicted:
        text = resolve_imports((scratch / rel).read_text(encoding="utf-8", errors="replace"))
        if text is None:
            why = f"it conflicts with {head[:10]} beyond import lines in {rel}"
            break
        resolved[rel] = text
    if not conflicted:  # failed for another reason (empty: already in the base, a hook, ...)
        why = (proc.stderr.strip() or proc.stdout.strip() or "git cherry-pick failed").replace(
            "\n", " "
        )
    if why:
        git.run(scratch, "cherry-pick", "--abort", check=False)
        git.run(scratch, "reset", "-q", "--hard", head)
        return why, conflicted
    for rel, text in resolved.items():
        (scratch / rel).write_text(text, encoding="utf-8")
    git.run(scratch, "add", "--", *resolved)
    notes = "".join(
        f"\t{rel} (import block: the base's and the commit's imports, merged per module)\n"
        for rel in resolved
    )
    _commit(scratch, env, _picked_message(scratch, sha, f"Conflicts:\n{notes}", who), tmp)
    return "", []


def _picked_message(scratch: Path, sha: str, note: str, who: Identity) -> str:
    """Upstream's message of `sha`, `-x`'s line, a note on its conflicts, the runner's sign-off."""
    original = git.out(scratch, "log", "-1", "--format=%B", sha)
    full = git.out(scratch, "rev-parse", sha)
    return f"{original}\n(cherry picked from commit {full})\n\n{note.rstrip()}\n\n{who.signoff}\n"


def _commit(scratch: Path, env: dict[str, str], message: str, tmp: Path) -> None:
    msg_file = tmp / "message"
    msg_file.write_text(message, encoding="utf-8")
    # after a stopped cherry-pick, `git commit` keeps the picked commit's author
    git.run(
        scratch,
        "commit",
        "-q",
        "--no-verify",
        "-F",
        str(msg_file),
        env=env,
    )


def _author_env(scratch: Path, sha: str) -> dict[str, str]:
    name, email, date = git.out(scratch, "log", "-1", "--format=%an%x00%ae%x00%aD", sha).split("\0")
    return {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": date}


# --- what is built: units (one PR each) and targets (the branches they go to) -----------------


@dataclass
class Unit:
    """One upstream PR of the series: a fix of ours, or one carried upstream commit."""

    key: str  # "fix-2", "cherry-pick-5077": the branch name after the target's prefix
    fix: int
    patches: list[Patch]
    on: str | None = None  # the unit whose branch this one is built on
    carried: bool = False  # upstream's own commit, carried by the series (not ours)

    @property
    def commit(self) -> str:
        return self.patches[0].upstream_commit if self.carried else ""


@dataclass
class Target:
    """A base commit the PRs go to (upstream's main, dev, ...) and its baseline."""

    base: str
    baseline: Baseline
    why: str  # how the baseline was found (said to the user)
    prefix: str  # "mcore-fixes/" on the canonical baseline, "mcore-fixes/dev/" on dev
    label: str  # "Main", "Dev": the PR title's prefix

    def branch(self, unit: Unit) -> str:
        return f"{self.prefix}{unit.key}"


@dataclass
class Built:
    """A unit built for a target: its tip, or why there is no branch for it there."""

    unit: Unit
    tip: str = ""
    inputs: str = ""  # hash of what it was made from (branch.<name>.mcoreFixesInputs)
    on: str = ""  # what it was built on, in words
    skipped: str = ""  # why this target gets no branch for the unit (carried: already there)
    reused: bool = False  # the existing branch is current: kept as it is
    picked: list[tuple[str, list[str]]] = field(default_factory=list)  # upstream sha, ids
    backported: str = ""  # carried, conflicting: why the series' patch stands in for it
    conflicted: list[str] = field(default_factory=list)  # ... the files of that conflict
    ours: list[Patch] = field(default_factory=list)  # patches committed from the series
    stacked: list[str] = field(default_factory=list)  # units it needs the code of
    notes: list[str] = field(default_factory=list)  # said to the user after the build
    n_commits: int = 0


def is_carried(m: Manifest, p: Patch) -> bool:
    """Upstream's own commit, carried by the series (not ours): it names its `upstream-commit`,
    and its manifest `origin` (upstream, upstream-pr) or its message's DEP-3 `Origin:` says so."""
    if not p.upstream_commit:
        return False
    if p.origin:
        return p.origin in ("upstream", "upstream-pr")
    path = m.root / p.file
    if not path.is_file():
        return False
    return any(k == "Origin" for k, _ in parse_message(read_patch(path)).trailers)


def plan(m: Manifest, only: list[int] | None, pr_of: Callable[[str], str]) -> list[Unit]:
    """The units in series order (a required unit comes first); `only`: these fixes' units."""
    units: dict[str, Unit] = {}
    owner: dict[str, str] = {}
    for p in m.patches:
        if is_carried(m, p):
            pr = p.upstream_pr or pr_of(p.upstream_commit)
            key = f"cherry-pick-{pr or p.upstream_commit[:10]}"
            unit = units.setdefault(key, Unit(key, p.fix, [], carried=True))
        else:
            unit = units.setdefault(f"fix-{p.fix}", Unit(f"fix-{p.fix}", p.fix, []))
        unit.patches.append(p)
        owner[p.id] = unit.key
    order = list(units)
    for unit in units.values():
        needs = {owner[r] for p in unit.patches for r in p.requires if owner[r] != unit.key}
        unit.on = max(needs, key=order.index) if needs else None
    fixes = {u.fix for u in units.values()}
    if only:
        unknown = sorted(set(only) - fixes)
        if unknown:
            raise UserError(f"no fix {unknown} in the series; fixes: {sorted(fixes)}")
    return list(units.values())


def pr_number(repo: Path, sha: str) -> str:
    proc = git.run(repo, "log", "-1", "--format=%s", f"{sha}^{{commit}}", check=False)
    m = _PR_NUMBER.search(proc.stdout.strip()) if proc.returncode == 0 else None
    return m.group(1) if m else ""


def _commit_of(repo: Path, rev: str) -> str:
    proc = git.run(repo, "rev-parse", "-q", "--verify", f"{rev}^{{commit}}", check=False)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def targets(
    m: Manifest, checkout: Path, scratch: Path, onto: list[str] | None, say: Callable[[str], None]
) -> list[Target]:
    """The targets asked for (`--onto`, else main's and dev's pins), each with its baseline,
    detected in the scratch clone as `apply` detects a checkout's."""
    wanted: list[tuple[str, str]] = []  # (commit, as named)
    for ref in onto or []:
        commit = _commit_of(checkout, ref)
        if not commit:
            raise UserError(f"{ref!r} is not a commit of {checkout}")
        wanted.append((commit, ref))
    if not onto:
        canonical = m.baseline(m.canonical)
        base = canonical.commit if canonical.is_git else _commit_of(checkout, "main")
        if not base or not git.ok(checkout, "cat-file", "-e", f"{base}^{{commit}}"):
            raise UserError(
                f"{base or 'main'} ({m.canonical}) is not in {checkout}; git fetch there"
            )
        wanted.append((base, m.canonical))
        for name in UPSTREAM_BRANCHES:
            b = m.baselines.get(name)
            if b is None or name == m.canonical or not b.is_git:
                continue
            if not git.ok(checkout, "cat-file", "-e", f"{b.commit}^{{commit}}"):
                say(
                    f"{name}: pinned commit {b.commit[:10]} is not in {checkout} (git fetch origin "
                    f"{b.ref} there): no [{_label(name)}] branches"
                )
                continue
            wanted.append((b.commit, name))
    found: list[Target] = []
    for commit, named in wanted:
        git.run(scratch, "checkout", "-q", "-f", "--detach", commit)
        try:
            b, why = detect_baseline(m, scratch)
        except UserError:
            raise UserError(
                f"{named} ({commit[:10]}) is on no baseline's line of the series (main, dev, a "
                "release tag): nothing to build on"
            ) from None
        twin = [t for t in found if t.baseline.name == b.name]
        if twin:
            raise UserError(
                f"{named} and {twin[0].base[:10]} are both {b.name} ({why}): one set of "
                "branches per baseline"
            )
        prefix = BRANCH_PREFIX if b.name == m.canonical else f"{BRANCH_PREFIX}{b.name}/"
        found.append(Target(commit, b, why, prefix, _label(b.name)))
    return found


def _label(name: str) -> str:
    return name.capitalize() if name in UPSTREAM_BRANCHES else name


# --- branches in the checkout: what exists, whether the tool made it ---------------------------


@dataclass
class Existing:
    tip: str
    recorded: str
    inputs: str
    previous: str  # the tip a killed run was replacing (its refs never moved)

    @property
    def ours(self) -> bool:
        return bool(self.recorded) and self.tip in (self.recorded, self.previous)

    def current(self, inputs: str) -> bool:
        return self.ours and self.tip == self.recorded and self.inputs == inputs


def existing(checkout: Path, name: str) -> Existing | None:
    tip = _commit_of(checkout, f"refs/heads/{name}")
    if not tip:
        return None
    keys = (RECORD_KEY, INPUTS_KEY, PREVIOUS_KEY)
    return Existing(tip, *(_config(checkout, f"branch.{name}.{k}") for k in keys))


def _worktree_branches(checkout: Path) -> dict[str, str]:
    out = git.out(checkout, "worktree", "list", "--porcelain")
    found: dict[str, str] = {}
    path = ""
    for line in out.splitlines():
        if line.startswith("worktree "):
            path = line[len("worktree ") :]
        elif line.startswith("branch refs/heads/"):
            found[line[len("branch refs/heads/") :]] = path
    return found


def check_clobber(checkout: Path, branches: list[str]) -> None:
    """Refuse (nothing changed) a branch the tool did not make, one checked out somewhere, or
    a name git cannot make because a branch is a folder of it or it is a folder of a branch."""
    checked_out = _worktree_branches(checkout)
    for name in branches:
        below = git.out(
            checkout,
            "for-each-ref",
            "--count=1",
            "--format=%(refname:short)",
            f"refs/heads/{name}/",
        )
        parts = name.split("/")
        folders = ["/".join(parts[:i]) for i in range(1, len(parts))]
        above = [f for f in folders if _commit_of(checkout, f"refs/heads/{f}")]
        if below or above:
            clash = below or above[0]
            raise CheckFailed(
                f"branch {clash} exists, so git cannot make branch {name} (a branch name cannot "
                f"also be a folder of branches); rename {clash} (`git branch -m {clash} NEW`) "
                "and run again (nothing was changed)"
            )
        found = existing(checkout, name)
        if found is None:
            continue
        if name in checked_out:
            raise CheckFailed(
                f"branch {name} is checked out in {checked_out[name]}; switch that work tree to "
                "another branch first (nothing was changed)"
            )
        if not found.recorded:
            raise CheckFailed(
                f"branch {name} exists and was not made by mcore_fixes; rename or delete it "
                "first (nothing was changed)"
            )
        if not found.ours:
            raise CheckFailed(
                f"branch {name} has commits mcore_fixes did not make (tip {found.tip[:10]}, "
                f"made {found.recorded[:10]}); rename it or reset it first (nothing was changed)"
            )


def proven_on(root: Path, m: Manifest, patches: list[Patch]) -> list[str]:
    """Baselines where `prove` recorded every patch of the fix as proven (same diffs, same pin)."""
    from .prove import attach_proofs, load_proofs  # noqa: PLC0415

    found: list[str] = []
    ids = {p.id for p in patches}
    for b in m.baselines.values():
        store = load_proofs(root, b.name)
        cells = [Cell(p.id, b.name, APPLIES, file=str(f.relative_to(m.root))) for p in m.patches
                 if p.id in store and (f := m.patch_file(b, p)) is not None]  # fmt: skip
        attach_proofs(root, m, b, cells)
        verdicts = [c.proof.get("verdict") for c in cells if c.patch in ids]
        if verdicts and len(verdicts) == len(ids) and all(v == "proven" for v in verdicts):
            found.append(b.name)
    return found


# --- the scratch clone ---------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(tmpdir: Path) -> list[Path]:
    """Remove the scratch clones of killed runs: ours (prefix, owner, marker) whose process on
    this host is gone. Returns what was removed."""
    removed: list[Path] = []
    host = socket.gethostname()
    for path in tmpdir.glob(f"{SCRATCH_PREFIX}*"):
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            pid, _, where = (path / SCRATCH_MARKER).read_text().strip().partition(" ")
            if where != host or _alive(int(pid)):
                continue
        except (OSError, ValueError):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """A private temp dir, removed on return, error, Ctrl-C, SIGTERM and SIGHUP."""
    clean_stale(Path(tempfile.gettempdir()))
    tmp = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX))
    (tmp / SCRATCH_MARKER).write_text(f"{os.getpid()} {socket.gethostname()}\n")
    handlers: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, _stop)
    try:
        yield tmp
    finally:
        for sig, old in handlers.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)  # type: ignore[arg-type]
        shutil.rmtree(tmp, ignore_errors=True)


def _scratch_clone(checkout: Path, tmp: Path) -> Path:
    """A clone sharing the checkout's objects; its git runs without hooks and without the
    user's global or system config (the commits' identity is passed explicitly)."""
    scratch = tmp / "clone"
    git.run(
        tmp,
        "clone",
        "-q",
        "--shared",
        "--no-checkout",
        "--template=",
        str(checkout),
        str(scratch),
        env=git.NEUTRAL_CONFIG,
    )
    (scratch / ".git" / git.TOOL_TREE_MARKER).write_text("upstream scratch clone\n")
    git.run(scratch, "config", "core.hooksPath", os.devnull)
    return scratch


# --- building, per target ----------------------------------------------------------------------


@dataclass
class Build:
    """The series on one target in the scratch clone: the cells `apply` would report there and
    one commit per applied patch (`linear`), from which each unit's commits are cherry-picked."""

    scratch: Path
    m: Manifest
    target: Target
    who: Identity
    tmp: Path
    cells: dict[str, Cell] = field(default_factory=dict)
    linear: dict[str, str] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {**self.who.env, "GIT_EDITOR": "true"}

    def prepare(self) -> None:
        t = self.target
        git.run(self.scratch, "tag", "-f", "pristine", t.base)
        cells = apply_series(self.scratch, self.m, t.baseline)
        bad = [c for c in cells if c.state not in (*OK_STATES, "absent")]
        if bad:
            raise CheckFailed(
                f"patch {bad[0].patch} does not apply on {t.label} ({t.base[:10]}, "
                f"{t.baseline.name}: {t.why}): {bad[0].detail}; nothing was changed in the checkout"
            )
        self.cells = {c.patch: c for c in cells}
        self.linear = {c.patch: c.commit for c in cells if c.state == APPLIES}

    def inputs(self, unit: Unit, start: str) -> str:
        """What the unit's commits are made from on this target: same inputs, same commits."""
        t = self.target
        parts = [INPUTS_FORMAT, t.base, t.baseline.name, self.who.name, self.who.email, unit.key]
        for q in unit.patches:
            path = self.m.patch_file(t.baseline, q)
            digest = file_sha256(path) if path is not None and path.is_file() else ""
            parts += [q.id, self.cells[q.id].state, q.upstream_commit, digest]
        parts.append(start)
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]

    def skip_carried(self, unit: Unit, checkout: Path) -> str:
        """Why this target gets no cherry-pick of the carried commit ('' when it does)."""
        t, sha = self.target, unit.commit
        full = _commit_of(self.scratch, sha)
        if not full:
            return f"the checkout lacks upstream commit {sha[:10]}: fetch the branch that has it"
        subject = git.out(self.scratch, "log", "-1", "--format=%s", full)
        named = f"upstream commit {sha[:10]} ({subject})"
        if git.ok(self.scratch, "merge-base", "--is-ancestor", full, t.base):
            return f"{named} is already on {t.baseline.name}: nothing to send"
        states = {self.cells[q.id].state for q in unit.patches}
        if APPLIES not in states:
            return (
                f"{named}: {t.baseline.name} already has its change ({', '.join(sorted(states))})"
            )
        on_branch = git.out(
            checkout, "for-each-ref", "--count=1", "--contains", full, "refs/heads", "refs/remotes"
        )
        if any(q.origin == "upstream-pr" for q in unit.patches) or not on_branch:
            return (
                f"{named} is on no branch of the checkout (an open PR): its author's to send; "
                "the series carries it until upstream merges it"
            )
        return ""

    def build(self, unit: Unit, start: str, r: Built) -> None:
        """The unit's commits on `start` (r.tip): upstream's own commits first where the target
        lacks them (cherry-picked; left out where it has them), then ours from `linear`."""
        s, t = self.scratch, self.target
        git.run(s, "checkout", "-q", "-f", "--detach", start)
        r.picked, r.ours, r.notes, r.backported, r.conflicted, r.n_commits = [], [], [], "", [], 0
        replaced: set[str] = set()
        found: dict[str, list[str]] = {}
        for q in unit.patches:
            if q.upstream_commit:
                found.setdefault(q.upstream_commit, []).append(q.id)
        for sha, ids in found.items():
            named = f"upstream commit {sha[:10]} ({', '.join(ids)})"
            full = _commit_of(s, sha)
            if not full:
                r.notes.append(f"the checkout lacks {named}: built from our patches")
                continue
            if git.ok(s, "merge-base", "--is-ancestor", full, "HEAD"):
                r.notes.append(f"{named} is already on {t.baseline.name}: its patches are left out")
                replaced.update(ids)
                continue
            why, conflicted = _cherry_pick(s, full, self.env, self.who, self.tmp)
            if not why:
                r.picked.append((full, ids))
                replaced.update(ids)
            elif unit.carried and conflicted:
                r.backported, r.conflicted = why, conflicted
                r.notes.append(
                    f"{named} not cherry-picked ({why}): the series' backport for "
                    f"{t.baseline.name} instead, upstream's author and message kept"
                )
            elif unit.carried:
                r.skipped = f"{named} not cherry-picked: {why}"
                r.tip = start
                return
            else:
                r.notes.append(f"{named} not cherry-picked ({why}): built from our patches")
        for q in unit.patches:
            if q.id in replaced:
                continue
            if q.id not in self.linear:
                c = self.cells[q.id]
                r.notes.append(f"{q.id} is left out: {c.state} on {t.baseline.name} ({c.detail})")
                continue
            proc = git.run(
                s, "cherry-pick", "--no-commit", self.linear[q.id], check=False, env=self.env
            )
            if proc.returncode != 0:
                git.run(s, "cherry-pick", "--abort", check=False)
                git.run(s, "reset", "-q", "--hard", start)
                raise CheckFailed(
                    f"patch {q.id} ({unit.key}) conflicts with {start[:10]} without the earlier "
                    "fixes of the series; nothing was changed in the checkout"
                )
            path = self.m.patch_file(t.baseline, q)
            assert path is not None  # in linear: it applied
            if unit.carried:  # the series' backport stands in for upstream's commit
                env = {**self.env, **_author_env(s, unit.commit)}
                why = self.target.baseline.backports.get(q.id, "")
                files = "".join(f"\t{rel}\n" for rel in r.conflicted)
                note = (
                    f"Conflicts:\n{files}"
                    f"Resolved as mcore-fixes' backport for {t.baseline.name} "
                    f"({path.relative_to(self.m.root.parent)}){': ' + why if why else ''}"
                )
                _commit(s, env, _picked_message(s, unit.commit, note, self.who), self.tmp)
            else:
                _commit(
                    s,
                    self.env,
                    upstream_message(parse_message(read_patch(path)), self.who),
                    self.tmp,
                )
            r.ours.append(q)
            r.n_commits += 1
        r.n_commits += len(r.picked)
        r.tip = git.out(s, "rev-parse", "HEAD")
        if r.tip == start:
            r.skipped = f"nothing left to send on {t.baseline.name}: " + "; ".join(r.notes)


def build_target(b: Build, units: list[Unit], wanted: set[str], checkout: Path) -> dict[str, Built]:
    """Each wanted unit (and what it is built on) for the target; see the module docstring."""
    t = b.target
    by_key = {u.key: u for u in units}
    order = [u.key for u in units]
    results: dict[str, Built] = {}

    def built(unit: Unit) -> Built:
        if unit.key in results:
            return results[unit.key]
        r = results[unit.key] = Built(unit)
        dep = built(by_key[unit.on]) if unit.on else None
        if unit.carried and (why := b.skip_carried(unit, checkout)):
            r.skipped = why
            return r
        start, start_inputs = t.base, t.base
        r.on = f"on {t.baseline.name} {t.base[:10]}"
        if dep is not None and dep.tip and not dep.skipped:
            start, start_inputs = dep.tip, dep.inputs
            r.on = f"on {t.branch(dep.unit)} ({dep.tip[:10]})"
            if dep.unit.key not in wanted and not dep.reused:
                r.on = (
                    f"on a fresh build of {dep.unit.key} ({dep.tip[:10]}), not on branch "
                    f"{t.branch(dep.unit)} ({_why_not(checkout, t.branch(dep.unit))}"
                    f"; `--fix {dep.unit.fix}` makes that branch)"
                )
        r.inputs = b.inputs(unit, start_inputs)
        try:
            b.build(unit, start, r)
        except CheckFailed:
            # needs the earlier units' code (touches the same lines): stack it on the whole
            # series before it, and say so in its description
            earlier = [by_key[k] for k in order[: order.index(unit.key)]]
            if not earlier or unit.on == earlier[-1].key:
                raise
            r.stacked = [e.key for e in earlier]
            stack_start, stack_inputs = t.base, t.base
            for e in earlier:
                below = Built(e)
                b.build(e, stack_start, below)
                stack_start, stack_inputs = below.tip, b.inputs(e, stack_inputs)
            r.inputs = b.inputs(unit, f"stacked:{stack_inputs}")
            r.on = f"on the series before it ({stack_start[:10]}: {', '.join(r.stacked)})"
            b.build(unit, stack_start, r)
        found = existing(checkout, t.branch(unit))
        if found is not None and found.current(r.inputs):
            r.tip, r.reused = found.tip, True  # the same commits were made before: keep them
        return r

    for unit in units:
        if unit.key in wanted:
            built(unit)
    return results


def _why_not(checkout: Path, name: str) -> str:
    found = existing(checkout, name)
    if found is None:
        return "no such branch"
    if not found.recorded:
        return "not made by mcore_fixes"
    if not found.ours:
        return "it has commits mcore_fixes did not make"
    return "made from other inputs"


# --- descriptions ------------------------------------------------------------------------------


def _having(b: Build, sha: str) -> list[str]:
    """Upstream branches (pinned in the manifest, present in the checkout) that contain `sha`."""
    names = []
    for name in UPSTREAM_BRANCHES:
        pin = b.m.baselines.get(name)
        if pin is not None and pin.is_git and git.ok(b.scratch, "cat-file", "-e", pin.commit):
            if git.ok(b.scratch, "merge-base", "--is-ancestor", sha, pin.commit):
                names.append(name)
    return names


def _picked_note(b: Build, r: Built) -> str:
    """The description's word on upstream's own commits: picked, backported, or already there."""
    s, t, lines = b.scratch, b.target, []
    unit = r.unit
    if unit.carried:
        sha = _commit_of(s, unit.commit)
        author = git.out(s, "log", "-1", "--format=%an <%ae>", sha)
        having = " and ".join(_having(b, sha)) or "upstream"
        how = (
            f"backported: the cherry-pick conflicts ({r.backported}); resolved as the series' "
            f"patch for {t.baseline.name}"
            if r.backported
            else f"`git cherry-pick -x {sha[:10]}`"
        )
        return (
            f"[{t.label}] cherry-pick of upstream's own commit {sha[:10]} (author {author}, kept), "
            f"which {having} has and {t.baseline.name} lacks: {how}."
        )
    for sha, ids in r.picked:
        author = git.out(s, "log", "-1", "--format=%an <%ae>", sha)
        subject = git.out(s, "log", "-1", "--format=%s", sha)
        lines.append(
            f"The first commit is upstream's own fix, `git cherry-pick -x {sha[:10]}` "
            f"({subject}; author {author}, kept), in place of our "
            f"{', '.join(f'`{i}`' for i in ids)}; our commits follow as separate commits."
        )
        having = [n for n in _having(b, sha) if n != t.baseline.name]
        for q in r.ours:
            if set(q.requires) & set(ids):
                subj = parse_message(read_patch(b.m.patch_file(t.baseline, q))).subject  # type: ignore[arg-type]
                where = (
                    f" On {', '.join(having)}, which already has {sha[:10]}, it closes what that "
                    "commit leaves open there too (its twin PR carries it there)."
                    if having
                    else ""
                )
                lines.append(f'"{subj}" builds on it and closes what it leaves open.{where}')
    for sha, ids in _in_base(b, r):
        subject = git.out(s, "log", "-1", "--format=%s", sha)
        lines.append(
            f"{t.baseline.name} already has upstream's own fix {sha[:10]} ({subject}): our "
            "commits build on it (the series' "
            f"{', '.join(f'`{i}`' for i in ids)}, which stand for it where it is missing, are "
            "left out here)."
        )
    return "\n\n".join(lines)


def _in_base(b: Build, r: Built) -> list[tuple[str, list[str]]]:
    picked = {sha for sha, _ in r.picked}
    found: dict[str, list[str]] = {}
    for q in r.unit.patches:
        full = _commit_of(b.scratch, q.upstream_commit) if q.upstream_commit else ""
        if full and full not in picked:
            if git.ok(b.scratch, "merge-base", "--is-ancestor", full, b.target.base):
                found.setdefault(full, []).append(q.id)
    return list(found.items())


def describe(
    root: Path, b: Build, r: Built, built: dict[str, Built], twins: list[str], tmpl: str
) -> str:
    """The PR description of `r` on its target: title, upstream's template filled in."""
    m, t, unit = b.m, b.target, r.unit
    messages = [_commit_message(b.scratch, sha) for sha, _ in r.picked]
    if unit.carried and r.backported:
        messages.append(_commit_message(b.scratch, _commit_of(b.scratch, unit.commit)))
    else:
        messages += [parse_message(read_patch(m.patch_file(t.baseline, q))) for q in r.ours]  # type: ignore[arg-type]
    texts = [read_patch(p) for q in r.ours if (p := m.patch_file(t.baseline, q))]
    tests = {f for text in texts for f in test_files(text)}
    for sha, _ in r.picked:
        files = git.out(b.scratch, "show", "--format=", "--name-only", sha).splitlines()
        tests |= {f for f in files if f.startswith("tests/")}
    depends = None
    if r.stacked:
        depends = "`, `".join(t.branch(built[k].unit) for k in r.stacked if k in built)
    elif unit.on and (dep := built.get(unit.on)) and dep.tip and not dep.skipped:
        depends = t.branch(dep.unit)
    own = messages[len(r.picked) :] or messages  # the title: our first commit's subject
    title = f"[{t.label}] {own[0].subject}"
    names = [f"fix-{unit.fix}.md"] if not unit.carried else []
    evidence = pr_texts(m, names + [f"{q.id}.md" for q in unit.patches])
    picked = _picked_note(b, r)
    if twins:
        picked += ("\n\n" if picked else "") + "Twin PR(s): " + ", ".join(twins) + "."
    return pr_description(
        tmpl,
        unit.fix,
        messages,
        sorted(tests),
        proven_on(root, m, unit.patches),
        depends,
        picked,
        evidence,
        title,
    )


def _commit_message(scratch: Path, sha: str) -> Message:
    lines = git.out(scratch, "log", "-1", "--format=%B", sha).splitlines()
    return parse_message(f"Subject: {lines[0]}\n\n" + "\n".join(lines[1:]).strip("\n") + "\n")


# --- the command ---------------------------------------------------------------------------------


@dataclass
class Made:
    branch: str
    tip: str
    inputs: str
    description: str
    path: Path  # build/upstream/<branch>.md
    unchanged: bool  # the existing branch is current: only its description is rewritten


def export(
    root: Path,
    m: Manifest,
    checkout: Path,
    onto: list[str] | str | None,
    only: list[int] | None,
    say: Callable[[str], None] = print,
) -> list[tuple[str, str, Path]]:
    """Make the branches; return (branch, tip, description file) per branch made."""
    who = identity(checkout)
    if isinstance(onto, str):
        onto = [onto]
    units = plan(m, only, lambda sha: pr_number(checkout, sha))
    wanted = {u.key for u in units if not only or u.fix in only}
    out_dir = root / "build" / "upstream"
    made: list[Made] = []
    summary: list[str] = []  # said once the branches are made
    with scratch_dir() as tmp:
        scratch = _scratch_clone(checkout, tmp)
        found = targets(m, checkout, scratch, onto, say)
        results: list[tuple[Build, dict[str, Built], str]] = []
        for t in found:
            b = Build(scratch, m, t, who, tmp)
            b.prepare()
            say(f"[{t.label}] {t.base[:10]}: {t.baseline.name} ({t.why})")
            results.append(
                (b, build_target(b, units, wanted, checkout), template(scratch, t.base, say))
            )
        for b, built, tmpl in results:
            t = b.target
            for unit in units:
                r = built.get(unit.key)
                if unit.key not in wanted or r is None:
                    continue
                name = t.branch(unit)
                if r.skipped:
                    say(f"{name}: no branch: {r.skipped}")
                    continue
                for note in r.notes:
                    say(f"{name}: {note}")
                twins = [
                    f"[{o.target.label}] `{o.target.branch(unit)}`"
                    for o, ob, _ in results
                    if o is not b
                    and ob.get(unit.key)
                    and ob[unit.key].tip
                    and not ob[unit.key].skipped
                ]
                desc = describe(root, b, r, built, twins, tmpl)
                path = out_dir / (name.replace("/", "-") + ".md")
                made.append(Made(name, r.tip, r.inputs, desc, path, r.reused))
                state = "unchanged, " if r.reused else ""
                summary.append(
                    f"{name}: [{t.label}] {r.n_commits} commit(s) {r.on}, {state}tip {r.tip[:10]}; "
                    f"description {path}"
                )
        if made:
            write_branches(checkout, scratch, made)
    out_dir.mkdir(parents=True, exist_ok=True)
    for mk in made:
        mk.path.write_text(mk.description, encoding="utf-8")
    for line in summary:
        say(line)
    say(f"author and Signed-off-by: {who.name} <{who.email}>; nothing was pushed")
    return [(mk.branch, mk.tip, mk.path) for mk in made]


def write_branches(checkout: Path, scratch: Path, made: list[Made]) -> None:
    """Into the checkout, all or nothing: the objects, the records, then every branch in one
    `git update-ref` transaction (a killed run leaves records that the next run accepts, and
    no branch it did not record)."""
    check_clobber(checkout, [mk.branch for mk in made])
    new = [mk for mk in made if not mk.unchanged]
    for i, mk in enumerate(new):
        git.run(scratch, "update-ref", f"refs/mcore-fixes-out/{i}", mk.tip)
    if new:  # objects only: no ref, no FETCH_HEAD, no gc in the user's repository
        refs = [f"refs/mcore-fixes-out/{i}" for i in range(len(new))]
        git.run(
            checkout,
            "fetch",
            "-q",
            "--no-tags",
            "--no-write-fetch-head",
            "--no-auto-maintenance",
            str(scratch),
            *refs,
        )
    keys = ("description", RECORD_KEY, INPUTS_KEY, PREVIOUS_KEY)
    before = {
        (mk.branch, k): _config(checkout, f"branch.{mk.branch}.{k}") for mk in made for k in keys
    }
    olds = {mk.branch: _commit_of(checkout, f"refs/heads/{mk.branch}") for mk in new}
    with git.signals_held():
        for mk in new:  # first: while the refs move, the old tip stays the tool's own
            if olds[mk.branch]:
                _set(checkout, mk.branch, PREVIOUS_KEY, olds[mk.branch])
        for mk in made:
            _set(checkout, mk.branch, "description", mk.description)
            _set(checkout, mk.branch, INPUTS_KEY, mk.inputs)
            _set(checkout, mk.branch, RECORD_KEY, mk.tip)
        lines = "".join(
            f"update refs/heads/{mk.branch} {mk.tip} {olds[mk.branch]}\n"
            if olds[mk.branch]
            else f"create refs/heads/{mk.branch} {mk.tip}\n"
            for mk in new
        )
        proc = git.run(
            checkout,
            "update-ref",
            "-m",
            "mcore_fixes upstream",
            "--stdin",
            check=False,
            input=lines.encode(),
        )
        if proc.returncode != 0:
            for (branch, key), value in before.items():
                _set(checkout, branch, key, value)
            reason = " ".join(proc.stderr.split()) or "git update-ref failed"
            raise CheckFailed(f"the branches were not made, nothing was changed: {reason}")
        for mk in new:
            _set(checkout, mk.branch, PREVIOUS_KEY, "")


def _set(repo: Path, branch: str, key: str, value: str) -> None:
    name = f"branch.{branch}.{key}"
    if value:
        git.run(repo, "config", name, value)
    else:
        git.run(repo, "config", "--unset-all", name, check=False)
