"""`python -m mcore_fixes audit` on checkpoints real MCore trees wrote (conftest.py, writers.py).

Every scenario triggers one bug (or none) in a real training state, saved as megatron/training
saves it; unpatched baselines write the damage, the fork does not. The audit must flag every
damaged checkpoint with the right evidence and pass every clean one: no missed damage, no
false alarm. Bad input (missing, empty, foreign, truncated) is one line and exit status 2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, Writer, Written, write_all

from mcore_fixes import cli

OK, DAMAGED, CANNOT_TELL = "ok", "damaged", "cannot tell"
FORMATS = ("fully_reshardable", "dp_reshardable", "dp_zero_gather_scatter", "legacy")
# Two pipeline stages where only stage 1 mixes fp32 and 16-bit params (in the dense optimizer,
# or in the expert one): read across versions only (test_loads_across_versions).
PIPELINE = [f"mixed-pp2-{kind}{f}" for kind in ("", "expert-") for f in FORMATS]
# Non-colocated MIMO, a DistributedOptimizer per module, where only the module off rank 0 mixes
# fp32 and bf16 params (torch_dist keeps rank 0's common state); in the second, every param is
# 1.0 (values cannot tell the layouts apart): across versions only too.
MIMO = ["mixed-mimo-fully_reshardable", "mixed-mimo-equal-dp_reshardable"]
STOCK_019 = [
    *(f"mixed-{f}" for f in FORMATS),
    *(f"dp2-pairs-{f}" for f in FORMATS),
    "aligned-dp_reshardable",
    "aligned-legacy",
    "coincide-fully_reshardable",
    "coincide-legacy",
    "chained-fully_reshardable",
    "chained-dp_reshardable",
    "chained-legacy",
    "mimo-fp16",
    "buckets-fully_reshardable",
    "buckets-dp_reshardable",
    "dp2-buckets-fully_reshardable",
    *PIPELINE,
    *MIMO,
]
FORK_019 = [
    *(f"mixed-{f}" for f in FORMATS),
    *(f"dp2-mixed-{f}" for f in FORMATS),
    "aligned-legacy",
    "coincide-fully_reshardable",
    "chained-fully_reshardable",
    "chained-dp_reshardable",
    "chained-legacy",
    "mimo-fp16",
    "buckets-fully_reshardable",
    "dp2-buckets-fully_reshardable",
    *PIPELINE,
    *MIMO,
]
PLAN = {
    # 0.13.1: its dist_checkpointing cannot save here (numpy 2); the legacy format can.
    Writer("0.13.1", False): ["mixed-legacy", "aligned-legacy", "chained-legacy"],
    Writer("0.16.1", False): [
        *(f"mixed-{f}" for f in FORMATS),
        "chained-fully_reshardable",
        "chained-dp_reshardable",
        "buckets-fully_reshardable",
        "coincide-fully_reshardable",
    ],
    Writer("0.19.2", False): STOCK_019,
    Writer("0.19.2", True): FORK_019,
}
if os.environ.get("MCORE_REPO"):  # git baselines: upstream main (pristine, forked) and dev
    PLAN[Writer("main", False)] = ["mixed-fully_reshardable", "mixed-legacy", "chained-legacy",
                                   "buckets-fully_reshardable", *PIPELINE, *MIMO]  # fmt: skip
    PLAN[Writer("main", True)] = ["mixed-fully_reshardable", "mixed-dp_reshardable",
                                  "chained-legacy", "buckets-fully_reshardable",
                                  *PIPELINE, *MIMO]  # fmt: skip
    PLAN[Writer("dev", False)] = ["mixed-fully_reshardable", "mixed-legacy",
                                  "buckets-fully_reshardable"]  # fmt: skip
CASES = [(w, s) for w, scenarios in PLAN.items() for s in scenarios if s not in PIPELINE + MIMO]


@pytest.fixture(scope="session")
def written(tmp_path_factory) -> dict[Writer, Written | str]:
    return write_all(PLAN, tmp_path_factory)


def run_audit(path: Path, *extra: str, capsys) -> tuple[int, str, str]:
    code = cli.main(["audit", str(path), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def audit_json(path: Path, capsys) -> tuple[int, dict]:
    code, out, err = run_audit(path, "--json", capsys=capsys)
    assert err == "", err
    return code, json.loads(out)


def expected(scenario: str, fork: bool, w: Written) -> dict[str, str]:
    """The verdicts a checkpoint of `scenario` must get, from what the writer's tree does."""
    kind = scenario.removeprefix("dp2-").split("-")[0]
    verdicts = {"loss-scale": OK, "param-index": OK, "reshard-padding": OK}
    verdicts |= {"param-groups": OK, "step": OK}  # one run, never resumed: test_resume_audit.py
    if kind in ("mixed", "pairs") and not w.code("[*model_fp32_params, *model_float16_params]"):
        verdicts["param-index"] = DAMAGED  # the grad-buffer-order index (not #5835's, not ours)
    if kind == "coincide" and not w.code("param_index_layout"):
        verdicts["param-index"] = CANNOT_TELL  # values cannot tell; a layout record can
    if kind in ("chained", "mimo") and not fork:
        verdicts["loss-scale"] = DAMAGED
    if (
        kind == "buckets"
        and scenario.endswith("fully_reshardable")
        and not w.code("cumulative_padding_stripped")  # upstream #5077 (main; carried by fork)
    ):
        verdicts["reshard-padding"] = DAMAGED
    return verdicts


def _params(moved: list[str]) -> set[str]:
    """The params an evidence list names: those held, and (model space) their holders."""
    names = set()
    for line in moved:
        holder, _, held = line.partition(" holds the main param of ")
        sides = [held] if holder.startswith("the ") else [held, holder]  # "the fp32 buffer of"
        names.update(side.split()[-1].split(":")[-1].removeprefix("module.") for side in sides)
    return names


def check_evidence(scenario: str, fork: bool, report: dict) -> None:
    """The evidence names the params and numbers the bug leaves."""
    checks = {c["check"]: c for c in report["checks"]}
    loss, index, padding = (checks[n] for n in ("loss-scale", "param-index", "reshard-padding"))
    states = {(s["scale"], s["growth_tracker"], s["hysteresis_tracker"])
              for s in loss["evidence"]["scalers"]}  # fmt: skip
    if scenario.startswith("chained-"):
        # dense: a clean step then a clean one; expert: a clean step then an overflow
        assert states == ({(4.0, 0, 0)} if fork else {(8.0, 2, 1), (4.0, 0, 0)}), states
        assert len(loss["evidence"]["scalers"]) == 2
    if scenario == "mimo-fp16":
        assert states == ({(4.0, 0, 0)} if fork else {(4.0, 0, 0), (8.0, 1, 1)}), states
    if index["verdict"] == DAMAGED and scenario.startswith("mixed-fully_reshardable"):
        # grad-buffer order: bf16 params reversed, then the fp32 one; the group stores the
        # fp32 one first: each param's slot holds the main param of the one stored there
        expected = {
            f"module.{a}.{w} holds the main param of module.{b}.{w}"
            for a, b in (("out", "child"), ("inp", "out"), ("child", "inp"))
            for w in ("weight", "bias")
        }
        assert set(index["evidence"]["moved"]) == expected, index["evidence"]["moved"]
    elif index["verdict"] == DAMAGED and "mixed-" in scenario:
        # buffer space: the fp32 params' main params sit in the 16-bit buffer and vice versa
        moved = index["evidence"]["moved"]
        assert _params(moved) == {"child.weight", "child.bias", "inp.weight", "inp.bias"}, moved
    elif index["verdict"] == DAMAGED and "pairs-" in scenario:
        moved = index["evidence"]["moved"]
        assert _params(moved) == {"a.weight", "b.weight", "c.weight", "d.weight"}, moved
    if index["verdict"] == OK and "mixed-" in scenario and fork:
        assert index["summary"].startswith(("storage order", "recorded layout")), index
    if padding["verdict"] == DAMAGED:
        shifted = padding["evidence"]["shifted"]
        assert any("module.layer1.weight (shifted by 48 elements" in s for s in shifted), shifted
    if scenario.startswith("mixed-") and not fork and scenario.endswith(("reshardable", "legacy")):
        # torch Adam: stock loads dp_reshardable; the formats without a per-param step fail
        fails = not scenario.endswith("dp_reshardable")
        assert index["on_load"]["stock"].startswith("fails to load it with torch Adam") == fails
    if scenario.startswith("coincide-") and index["verdict"] == CANNOT_TELL:
        assert index["evidence"]["coincide"], index


@pytest.mark.parametrize(
    ("writer", "scenario"), CASES, ids=[f"{w.label}/{s}".replace(" ", "-") for w, s in CASES]
)
def test_verdicts(written, writer, scenario, capsys):
    w = written[writer]
    if isinstance(w, str):
        pytest.skip(w)
    outcome = w.outcomes[scenario]
    if outcome != "ok":
        pytest.skip(f"{writer.label} cannot write {scenario}: {outcome}")
    path = w.out / scenario
    code, report = audit_json(path, capsys)
    got = {c["check"]: c["verdict"] for c in report["checks"]}
    want = expected(scenario, writer.fork, w)
    assert got == want, json.dumps(report, indent=1)
    assert code == (1 if DAMAGED in want.values() else 0)
    check_evidence(scenario, writer.fork, report)
    assert all(c["what_to_do"] for c in report["checks"] if c["verdict"] != OK), report
    code_text, out, err = run_audit(path, capsys=capsys)
    lines = [line for line in out.splitlines() if not line.startswith(" ")]  # first lines
    assert code_text == code and err == ""
    assert len(lines) == 1 + len(want)  # the checkpoint, then one line per check
    for line, (check, verdict) in zip(lines[1:], want.items(), strict=True):
        assert line.startswith(f"{check}: {verdict}: "), line


def test_fork_records_its_layout(written, capsys):
    """Enabled once the series records its param index layout (the fix-2 layout patch): every
    checkpoint the fork writes says which index wrote it, and the audit reads the record."""
    w = written[Writer("0.19.2", True)]
    if isinstance(w, str):
        pytest.skip(w)
    if not w.code("param_index_layout"):
        pytest.skip("the series does not record the param index layout yet")
    for scenario in (*(f"mixed-{f}" for f in FORMATS), "chained-legacy"):
        _, report = audit_json(w.out / scenario, capsys)
        index = report["checks"][1]
        assert index["verdict"] == OK and index["summary"].startswith("recorded layout"), index
        assert set(index["evidence"]["records"].values()) == {"storage_order"}, index
        # where stock's index would misread a mixed group, stock cannot load it at all
        misread = scenario.startswith("mixed-")
        assert index["on_load"]["stock"].startswith("fails to load it (an error)") == misread
        # the lock-in said on the verdict's line, with what to do (still ok: nothing damaged)
        assert ("Stock megatron-core will refuse" in index["summary"]) == misread, index
        assert index["what_to_do"].startswith("stock megatron-core will refuse") == misread


# --- read-only, and bad input ---------------------------------------------------------------


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def _stock(written) -> Written:
    w = written[Writer("0.19.2", False)]
    if isinstance(w, str):
        pytest.skip(w)
    return w


def test_never_writes_to_the_checkpoint(written, tmp_path, capsys):
    src = _stock(written).out / "mixed-dp_reshardable"
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    before = _snapshot(ckpt)
    for p in [ckpt, *ckpt.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        code, _, _ = run_audit(ckpt, capsys=capsys)
        assert code == 1
        assert _snapshot(ckpt) == before
    finally:
        for p in [ckpt, *ckpt.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)


def _one_line_error(path: Path, capsys, *needles: str) -> None:
    code, out, err = run_audit(path, capsys=capsys)
    assert code == 2, (out, err)
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("mcore_fixes: error: "), err
    for needle in needles:
        assert needle in err, err


def test_missing_empty_and_foreign(tmp_path, capsys):
    _one_line_error(tmp_path / "nope", capsys, "does not exist")
    (tmp_path / "empty").mkdir()
    _one_line_error(tmp_path / "empty", capsys, "is empty")
    foreign = tmp_path / "hf"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    (foreign / "model.safetensors").write_bytes(b"\0" * 64)
    _one_line_error(foreign, capsys, "not a Megatron checkpoint")
    _one_line_error(foreign / "config.json", capsys, "is a file")
    (tmp_path / "save").mkdir()
    (tmp_path / "save" / "latest_checkpointed_iteration.txt").write_text("20")
    _one_line_error(tmp_path / "save", capsys, "iter_0000020")
    (tmp_path / "save" / "latest_checkpointed_iteration.txt").write_text("garbage")
    _one_line_error(tmp_path / "save", capsys, "expected an iteration number")


def _copy(written, scenario: str, tmp_path: Path) -> Path:
    dest = tmp_path / scenario
    shutil.copytree(_stock(written).out / scenario, dest)
    return dest / "iter_0000001"


def test_truncated_and_corrupt(written, tmp_path, capsys):
    ckpt = _copy(written, "mixed-fully_reshardable", tmp_path)
    (ckpt / ".metadata").unlink()
    _one_line_error(ckpt, capsys, "no .metadata")
    ckpt = _copy(written, "mixed-dp_reshardable", tmp_path)
    distcp = sorted(ckpt.glob("*.distcp"))[0]
    os.truncate(distcp, distcp.stat().st_size // 2)
    _one_line_error(ckpt, capsys, "truncated")
    ckpt = _copy(written, "mixed-legacy", tmp_path)
    optim = ckpt / "mp_rank_00" / "distrib_optim.pt"
    os.truncate(optim, optim.stat().st_size - 100)
    _one_line_error(ckpt, capsys, "distrib_optim.pt")
    (ckpt / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"not a zip")
    _one_line_error(ckpt, capsys, "model_optim_rng.pt")
    ckpt = _copy(written, "chained-dp_reshardable", tmp_path)
    (ckpt / ".metadata").write_bytes(b"\x80\x04garbage")
    _one_line_error(ckpt, capsys, ".metadata")


def test_command_line_one_line_without_numpy(tmp_path):
    """Without numpy the verb says so in one line, in JSON with --json (the rest of the tool
    needs none)."""
    code = (
        "import sys; sys.modules['numpy'] = None; from mcore_fixes.cli import main; "
        f"sys.exit(main(['audit', {str(tmp_path)!r}]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2, proc
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert "numpy" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    code = code.replace("])", ", '--json'])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "numpy" in json.loads(proc.stdout)["error"], proc


# --- loads across versions (fix 2's layout record) -------------------------------------------

READER = Path(__file__).resolve().parent / "readers.py"
CROSS = ("mixed-", "coincide-", "aligned-")  # one_step scenarios at world size 1


def _read_with(reader: Written, writer: Written, tmp: Path) -> dict[str, str]:
    names = [n for n, o in writer.outcomes.items() if o == "ok" and n.startswith(CROSS)]
    out = tmp / "read.json"
    env = {**os.environ, "PYTHONPATH": str(reader.tree), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, str(READER), str(writer.out), str(out), *names],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


def _pairs() -> list[tuple[Writer, Writer]]:
    trees = [w for w in PLAN if w.baseline in ("0.19.2", "main")]
    return [(w, r) for w in trees for r in trees if w.fork or r.fork]


@pytest.mark.parametrize(
    ("writer", "reader"),
    _pairs(),
    ids=[f"{w.label}->{r.label}".replace(" ", "-") for w, r in _pairs()],
)
def test_loads_across_versions(written, writer, reader, tmp_path):
    """Checkpoints of mixed fp32/16-bit groups, written by a stock tree or the fork, loaded by
    the other: the fork gives every param its own state back (stock writes in grad-buffer order,
    unrecorded, values coinciding or not); stock loads what the fork wrote exactly or fails with
    an error, never permuted."""
    w, r = written[writer], written[reader]
    for x in (w, r):
        if isinstance(x, str):
            pytest.skip(x)
    outcomes = _read_with(r, w, tmp_path)
    assert outcomes, w.outcomes
    missing = [n for n in MIMO if n in PLAN[writer] and n not in outcomes]
    assert not missing, f"{writer.label} did not write {missing}: {w.outcomes}"
    for name, outcome in outcomes.items():
        assert not outcome.startswith(("permuted", "no outcome")), (name, outcome)
        if reader.fork and r.code("param_index_layout"):
            assert outcome == "exact", (name, outcome)
        elif writer.fork and w.code("param_index_layout") and name.startswith("mixed-"):
            assert outcome.startswith("error"), (name, outcome)
            # the error names the cause and the way out (unless stock's torch Adam load fails
            # first, on its own checkpoints too)
            if w.code("refused_because") and "KeyError: 'step'" not in outcome:
                assert "param_index_layout" in outcome, (name, outcome)
