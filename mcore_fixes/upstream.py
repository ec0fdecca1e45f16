"""`upstream`: one branch per upstream PR in the user's Megatron-LM checkout, ready to send.

For each fix of the series: a branch ``mcore-fixes/fix-N`` on the checkout's base (by default
the pinned commit of the canonical baseline, ``--onto REF`` otherwise) with one commit per
patch of the fix. A fix whose patches require another fix's patches (fix 1 on fix 4) is built
on top of that fix's branch. Commits are authored, committed and signed off (DCO
``Signed-off-by:``) by the git identity of the person running the tool (refused when none is
configured); the project-only trailers (DEP-3 ``Bug``/``Forwarded``/``Applied-Upstream``,
``Proven-on``) and the tool's own sign-off leave the message. The PR description, written from
the checkout's pull-request template, goes into ``branch.<name>.description`` (git's own place
for it: ``git format-patch --cover-letter``, ``git request-pull`` read it) and into
build/upstream/<branch>.md; a ``Bug`` URL of an upstream issue becomes ``Fixes #N`` there.

Everything is built in a scratch clone that shares the checkout's objects; only then are the
branches fetched into the checkout, which never has its work tree, index or HEAD touched. A
branch the tool did not make (no ``branch.<name>.mcoreFixes`` record, or a tip other than the
recorded one) is never overwritten, nor a branch checked out in a work tree. Nothing is pushed.
"""

from __future__ import annotations

import ast
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import git
from .errors import CheckFailed, UserError
from .manifest import Baseline, Manifest, Patch
from .series import APPLIES, Cell, read_patch, test_files

BRANCH_PREFIX = "mcore-fixes/"
RECORD_KEY = "mcoreFixes"  # branch.<name>.mcoreFixes = tip the tool made
PROJECT_TRAILERS = ("Bug", "Forwarded", "Applied-Upstream", "Proven-on", "Last-Update", "Origin")
TEMPLATE_PATHS = (
    ".github/PULL_REQUEST_TEMPLATE.md",
    ".github/pull_request_template.md",
    "PULL_REQUEST_TEMPLATE.md",
    "pull_request_template.md",
    "docs/pull_request_template.md",
)
_TRAILER = re.compile(r"^([A-Za-z][A-Za-z0-9-]*): (.*)$")
_ISSUE_URL = re.compile(r"https://github\.com/NVIDIA/Megatron-LM/(issues|pull)/(\d+)")
_OTHER_GH = re.compile(r"https://github\.com/([\w.-]+/[\w.-]+)/(issues|pull)/(\d+)")


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
    """The commit message upstream gets: project trailers and bot sign-offs out, runner's in."""
    bot = git.TOOL_IDENTITY["GIT_AUTHOR_EMAIL"]
    kept = [
        (k, v)
        for k, v in msg.trailers
        if k not in PROJECT_TRAILERS and not (k == "Signed-off-by" and bot in v)
    ]
    lines = [f"{k}: {v}" for k, v in kept]
    if who.signoff not in lines:
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


def template(checkout: Path, base: str) -> str:
    for rel in TEMPLATE_PATHS:
        proc = git.run(checkout, "show", f"{base}:{rel}", check=False)
        if proc.returncode == 0:
            return proc.stdout
    return "# What does this PR do?\n<!-- Add a one line overview -->\n\nLinked issue:\n"


def pr_description(
    tmpl: str,
    fix: int,
    messages: list[Message],
    tests: list[str],
    baselines: list[str],
    depends: str | None,
    picked: str = "",
) -> str:
    """Upstream's PR template, filled in: overview, linked issue, what was tested, where.

    `picked`: what the branch takes from upstream's own commits (cherry-picked), said first.
    """
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
    parts += [f"### {m.subject}\n\n{m.body}" for m in messages]
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
    return f"<!-- mcore-fixes fix {fix}: draft PR description; review every line -->\n{text}"


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
    scratch: Path, sha: str, ids: list[str], env: dict[str, str], who: Identity, tmp: str
) -> str:
    """`git cherry-pick -x` of upstream's `sha` onto HEAD, author and message kept, the runner's
    sign-off added; import-only conflicts resolved (both sides' imports, isort's layout) and
    listed in a "Conflicts:" note as upstream's cherry-picks do. '' when made, else why not
    (HEAD back where it was)."""
    head = git.out(scratch, "rev-parse", "HEAD")
    proc = git.run(scratch, "cherry-pick", "-x", "-s", sha, check=False, env=env)
    if proc.returncode == 0:
        return ""
    conflicted = git.out(scratch, "diff", "--name-only", "--diff-filter=U").splitlines()
    resolved: dict[str, str] = {}
    for rel in conflicted:
        text = resolve_imports((scratch / rel).read_text(encoding="utf-8"))
        if text is None:
            git.run(scratch, "cherry-pick", "--abort", check=False)
            git.run(scratch, "reset", "-q", "--hard", head)
            return f"it conflicts with the base beyond import lines in {rel}"
        resolved[rel] = text
    if not conflicted:  # failed for another reason (empty: already in the base, ...)
        git.run(scratch, "cherry-pick", "--abort", check=False)
        git.run(scratch, "reset", "-q", "--hard", head)
        return (proc.stderr.strip().splitlines() or ["git cherry-pick failed"])[0]
    for rel, text in resolved.items():
        (scratch / rel).write_text(text, encoding="utf-8")
    git.run(scratch, "add", "--", *resolved)
    original = git.out(scratch, "log", "-1", "--format=%B", sha)
    notes = "".join(
        f"\t{rel} (import block: the base's and the commit's imports, merged per module)\n"
        for rel in resolved
    )
    message = (
        f"{original}\n(cherry picked from commit {git.out(scratch, 'rev-parse', sha)})\n\n"
        f"Conflicts:\n{notes}\n{who.signoff}\n"
    )
    msg_file = Path(tmp) / f"cherry-pick-{sha[:12]}.msg"
    msg_file.write_text(message)
    # `git commit` after a stopped cherry-pick keeps the picked commit's author
    git.run(scratch, "commit", "-q", "--no-verify", "-F", str(msg_file), env=env)
    return ""


# --- branches --------------------------------------------------------------------------------


@dataclass
class Plan:
    fix: int
    branch: str
    patches: list[Patch]
    on: int | None  # the fix whose branch this one is built on
    stacked: list[int] = field(default_factory=list)  # conflicts without these fixes' commits
    picked: list[tuple[str, list[str]]] = field(default_factory=list)  # upstream sha, patch ids
    notes: list[str] = field(default_factory=list)  # said to the user after the build
    n_commits: int = 0  # the fix's own commits on the branch


def upstream_commits(p: Plan) -> list[tuple[str, list[str]]]:
    """The fix's `upstream-commit`s in series order, each with the patches it stands for."""
    found: dict[str, list[str]] = {}
    for q in p.patches:
        if q.upstream_commit:
            found.setdefault(q.upstream_commit, []).append(q.id)
    return list(found.items())


def plan(m: Manifest, only: list[int] | None) -> list[Plan]:
    by_fix: dict[int, list[Patch]] = {}
    for p in m.patches:
        by_fix.setdefault(p.fix, []).append(p)
    owner = {p.id: p.fix for p in m.patches}
    plans: list[Plan] = []
    for fix, patches in by_fix.items():  # series order: a required fix comes first
        needs = {owner[r] for p in patches for r in p.requires if owner[r] != fix}
        on = max(needs, key=lambda f: [q.fix for q in m.patches].index(f)) if needs else None
        plans.append(Plan(fix, f"{BRANCH_PREFIX}fix-{fix}", patches, on))
    if only:
        unknown = sorted(set(only) - set(by_fix))
        if unknown:
            raise UserError(f"no fix {unknown} in the series; fixes: {sorted(by_fix)}")
        plans = [p for p in plans if p.fix in only]
    return plans


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
    """Refuse (nothing changed) a branch the tool did not make, or one checked out somewhere."""
    checked_out = _worktree_branches(checkout)
    for name in branches:
        tip = git.run(checkout, "rev-parse", "-q", "--verify", f"refs/heads/{name}", check=False)
        if tip.returncode != 0:
            continue
        if name in checked_out:
            raise CheckFailed(
                f"branch {name} is checked out in {checked_out[name]}; switch that work tree to "
                "another branch first (nothing was changed)"
            )
        recorded = _config(checkout, f"branch.{name}.{RECORD_KEY}")
        if not recorded:
            raise CheckFailed(
                f"branch {name} exists and was not made by mcore_fixes; rename or delete it "
                "first (nothing was changed)"
            )
        if recorded != tip.stdout.strip():
            raise CheckFailed(
                f"branch {name} has commits mcore_fixes did not make (tip {tip.stdout.strip()[:10]}"
                f", made {recorded[:10]}); rename it or reset it first (nothing was changed)"
            )


def baseline_for(m: Manifest, checkout: Path, base_commit: str) -> Baseline:
    for b in m.baselines.values():
        if b.is_git and b.commit == base_commit:
            return b
    return m.baseline(m.canonical)


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


def export(
    root: Path, m: Manifest, checkout: Path, onto: str | None, only: list[int] | None, say=print
) -> list[tuple[str, str, Path]]:
    """Make the branches; return (branch, tip, description file) per branch."""
    who = identity(checkout)
    if onto:
        base = git.run(checkout, "rev-parse", "-q", "--verify", f"{onto}^{{commit}}", check=False)
        if base.returncode != 0:
            raise UserError(f"{onto!r} is not a commit of {checkout}")
        base_commit = base.stdout.strip()
    else:
        canonical = m.baseline(m.canonical)
        if canonical.is_git:
            base_commit = canonical.commit
        else:
            base_commit = git.out(checkout, "rev-parse", "main^{commit}")
        if not git.ok(checkout, "cat-file", "-e", f"{base_commit}^{{commit}}"):
            raise UserError(f"{base_commit} ({m.canonical}) is not in {checkout}; git fetch there")
    b = baseline_for(m, checkout, base_commit)
    all_plans = {p.fix: p for p in plan(m, None)}
    plans = [all_plans[p.fix] for p in plan(m, only)]
    check_clobber(checkout, [p.branch for p in plans])
    tmpl = template(checkout, base_commit)
    made: list[tuple[str, str, Path]] = []
    with tempfile.TemporaryDirectory(prefix="mcore-fixes-upstream-") as tmp:
        scratch = Path(tmp) / "clone"
        git.run(Path(tmp), "clone", "-q", "--shared", "--no-checkout", str(checkout), str(scratch))
        env = {**who.env, "GIT_EDITOR": "true"}
        linear = _linear(scratch, m, b, base_commit)
        tips: dict[int, str] = {}

        order = list(all_plans)

        def tip_of(p: Plan) -> str:
            if p.fix not in tips:
                start = tip_of(all_plans[p.on]) if p.on else base_commit
                try:
                    tips[p.fix] = _build(scratch, m, b, p, start, who, env, linear, tmp)
                except CheckFailed:
                    # needs the earlier fixes' code (touches the same lines): stack it on the
                    # whole series before it, and say so in its description
                    earlier = order[: order.index(p.fix)]
                    if not earlier or p.on == earlier[-1]:
                        raise
                    p.on, p.stacked = earlier[-1], earlier
                    stack_start = base_commit
                    for fix in earlier:
                        q = all_plans[fix]
                        stack_start = _build(scratch, m, b, q, stack_start, who, env, linear, tmp)
                    tips[p.fix] = _build(scratch, m, b, p, stack_start, who, env, linear, tmp)
            return tips[p.fix]

        for p in plans:
            tip_of(p)

        files = []
        for p in plans:
            git.run(scratch, "branch", "-f", p.branch, tips[p.fix])
        refspecs = [f"+refs/heads/{p.branch}:refs/heads/{p.branch}" for p in plans]
        git.run(checkout, "fetch", "-q", "--no-tags", str(scratch), *refspecs)
        out_dir = root / "build" / "upstream"
        out_dir.mkdir(parents=True, exist_ok=True)
        for p in plans:
            for note in p.notes:
                say(f"{p.branch}: {note}")
            picked = {i for _, ids in p.picked for i in ids}
            texts = [read_patch(m.patch_file(b, q)) for q in p.patches if m.patch_file(b, q)]
            messages = [_upstream_msg(scratch, sha) for sha, _ in p.picked]
            messages += [parse_message(read_patch(f)) for q in p.patches
                         if q.id not in picked and (f := m.patch_file(b, q))]  # fmt: skip
            tests = sorted({f for t in texts for f in test_files(t)})
            depends = all_plans[p.on].branch if p.on else None
            if p.stacked:
                depends = ", ".join(f"`{all_plans[f].branch}`" for f in p.stacked).strip("`")
            desc = pr_description(
                tmpl, p.fix, messages, tests, proven_on(root, m, p.patches), depends,
                _picked_note(scratch, m, p),
            )  # fmt: skip
            git.run(checkout, "config", f"branch.{p.branch}.description", desc)
            git.run(checkout, "config", f"branch.{p.branch}.{RECORD_KEY}", tips[p.fix])
            path = out_dir / (p.branch.replace("/", "-") + ".md")
            path.write_text(desc)
            files.append(path)
            made.append((p.branch, tips[p.fix], path))
            base_note = f"on {all_plans[p.on].branch}" if p.on else f"on {base_commit[:10]}"
            n = p.n_commits
            say(
                f"{p.branch}: {n} commit(s) {base_note}, tip {tips[p.fix][:10]}; description {path}"
            )
    say(f"author and Signed-off-by: {who.name} <{who.email}>; nothing was pushed")
    return made


def _upstream_msg(scratch: Path, sha: str) -> Message:
    lines = git.out(scratch, "log", "-1", "--format=%B", sha).splitlines()
    return parse_message(f"Subject: {lines[0]}\n\n" + "\n".join(lines[1:]).strip("\n") + "\n")


def _picked_note(scratch: Path, m: Manifest, p: Plan) -> str:
    """The description's word on upstream's commits at the start of the branch."""
    if not p.picked:
        return ""
    lines = []
    for sha, ids in p.picked:
        author = git.out(scratch, "log", "-1", "--format=%an <%ae>", sha)
        subject = git.out(scratch, "log", "-1", "--format=%s", sha)
        lines.append(
            f"The first commit is upstream's own fix, `git cherry-pick -x {sha[:10]}` "
            f"({subject}; author {author}, kept), in place of our "
            f"{', '.join(f'`{i}`' for i in ids)}; our commits follow as separate commits."
        )
        on_it = [q for q in p.patches if q.id not in ids and set(q.requires) & set(ids)]
        # branches that already have the commit (the manifest: fixed-upstream there)
        having = [b.name for b in m.baselines.values() if set(ids) <= set(b.fixed_upstream)]
        for q in on_it:
            path = m.patch_file(m.baseline(m.canonical), q)
            subj = parse_message(read_patch(path)).subject if path and path.exists() else q.id
            also = [n for n in having if q.id not in m.baseline(n).absent]
            where = (
                f" On {', '.join(also)}, which already has {sha[:10]}, it closes what that "
                "commit leaves open there too (the series carries it there)."
                if also
                else ""
            )
            lines.append(f'"{subj}" builds on it and closes what it leaves open.{where}')
    return "\n\n".join(lines)


def _linear(scratch: Path, m: Manifest, b: Baseline, base: str) -> dict[str, str]:
    """The whole series applied in order on `base` in the scratch clone: patch id -> commit."""
    git.run(scratch, "checkout", "-q", "-f", "--detach", base)
    commits: dict[str, str] = {}
    for q in m.patches:
        path = m.patch_file(b, q)
        if path is None:
            continue
        read_patch(path)
        proc = git.run(scratch, "apply", "--index", str(path), check=False)
        if proc.returncode != 0 and git.ok(scratch, "apply", "-R", "--check", str(path)):
            continue  # already in `base`: upstream's own commit, carried for the releases
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["conflict"])[-1]
            raise CheckFailed(
                f"patch {q.id} does not apply on {base[:10]}: {last}; nothing was changed in "
                "the checkout (pass --onto the commit the series targets)"
            )
        git.run(scratch, "commit", "-q", "--no-verify", "-m", q.id, env=git.TOOL_IDENTITY)
        commits[q.id] = git.out(scratch, "rev-parse", "HEAD")
    return commits


def _build(
    scratch: Path,
    m: Manifest,
    b: Baseline,
    p: Plan,
    start: str,
    who: Identity,
    env: dict[str, str],
    linear: dict[str, str],
    tmp: str,
) -> str:
    """The fix's commits on `start`; return the tip.

    First upstream's own commits where the manifest names one (`upstream-commit`, found in the
    checkout and cherry-picked with -x) in place of the patches they stand for, then the other
    patches, cherry-picked from the linear series (3-way: they apply on upstream's version of
    the code too, with the blobs they were made on).
    """
    git.run(scratch, "checkout", "-q", "-f", "--detach", start)
    p.picked, p.notes, p.n_commits = [], [], 0
    replaced: set[str] = set()
    for sha, ids in upstream_commits(p):
        named = f"upstream commit {sha[:10]} ({', '.join(ids)})"
        full = git.run(scratch, "rev-parse", "-q", "--verify", f"{sha}^{{commit}}", check=False)
        if full.returncode != 0:
            p.notes.append(f"the checkout lacks {named}: built from our patches")
            continue
        if git.ok(scratch, "merge-base", "--is-ancestor", full.stdout.strip(), "HEAD"):
            p.notes.append(f"{named} is already in the base: its patches are left out")
            replaced.update(ids)
            continue
        why = _cherry_pick(scratch, full.stdout.strip(), ids, env, who, tmp)
        if why:
            p.notes.append(f"{named} not cherry-picked ({why}): built from our patches")
            continue
        p.picked.append((full.stdout.strip(), ids))
        replaced.update(ids)
    for q in p.patches:
        if q.id not in linear or q.id in replaced:
            continue
        proc = git.run(scratch, "cherry-pick", "--no-commit", linear[q.id], check=False, env=env)
        if proc.returncode != 0:
            git.run(scratch, "cherry-pick", "--abort", check=False)
            raise CheckFailed(
                f"patch {q.id} (fix {p.fix}) conflicts with {start[:10]} without the earlier "
                "fixes of the series; nothing was changed in the checkout"
            )
        text = read_patch(m.patch_file(b, q))  # type: ignore[arg-type]
        msg_file = Path(tmp) / f"{q.id}.msg"
        msg_file.write_text(upstream_message(parse_message(text), who))
        git.run(scratch, "commit", "-q", "--no-verify", "-F", str(msg_file), env=env)
        p.n_commits += 1
    p.n_commits += len(p.picked)
    return git.out(scratch, "rev-parse", "HEAD")
