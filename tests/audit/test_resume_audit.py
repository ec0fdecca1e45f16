"""`audit` on runs saved, resumed and saved again (resumes.py): the param-groups and step checks.

Stock 0.18.2 (the PyPI sdist, file for file core_v0.18.2's megatron/core) writes the damage
of upstream #4705 (--decoupled-lr), #5213 (--override-opt-param-scheduler), #5976 (Megatron-FSDP
fully_shard(model, optimizer)) and fix 2's shared step; the trees that fix them write clean
controls: 0.19.2 (#4705), the fork of 0.18.2 (#5976, fix 2), upstream dev (#5213, with
MCORE_REPO). Every damaged checkpoint names its bug; no traceback.
"""

from __future__ import annotations

import os

import pytest
from conftest import Writer, write_all
from test_audit import DAMAGED, OK, audit_json, run_audit

SCENARIOS = [
    "decoupled-dp_reshardable",
    "decoupled-legacy-bf16",
    "override-dp_reshardable",
    "plain-dp_reshardable",
    "fsdp-step",
]
PLAN = {
    Writer("0.18.2", False): SCENARIOS,
    Writer("0.18.2", True): SCENARIOS,
    Writer("0.19.2", False): ["decoupled-dp_reshardable", "decoupled-legacy-bf16"],
}
if os.environ.get("MCORE_REPO"):
    PLAN[Writer("dev", False)] = ["override-dp_reshardable", "plain-dp_reshardable"]
CASES = [(w, s) for w, scenarios in PLAN.items() for s in scenarios]
# (baseline, fork) -> scenario -> {check: (verdict, the bug its summary names)}
FOUR_SEVEN = "#4705"


def expected(writer: Writer, scenario: str) -> dict[str, tuple[str, str]]:
    stock_018 = writer.baseline == "0.18.2" and not writer.fork
    shared_step = not writer.fork and scenario != "fsdp-step" and "legacy" not in scenario
    want = {"param-groups": (OK, ""), "step": (OK, "")}
    if scenario.startswith("decoupled-") and stock_018:  # no #4705 here (the fork carries it)
        want["param-groups"] = (DAMAGED, "#4705")
        if scenario.endswith("legacy-bf16"):  # params in two groups step twice
            want["step"] = (DAMAGED, "#4705")
    if scenario.startswith("override-") and writer.baseline != "dev":  # #5213: dev only
        want["param-groups"] = (DAMAGED, "#5213")
    if shared_step:  # fix 2's per-param step: the fork gives each param its own on load
        want["step"] = (DAMAGED, "distopt-mixed-precision-groups")
    if scenario == "fsdp-step" and stock_018:
        want["step"] = (DAMAGED, "#5976")
    return want


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return write_all(PLAN, tmp_path_factory)


@pytest.mark.parametrize(
    ("writer", "scenario"), CASES, ids=[f"{w.label}/{s}".replace(" ", "-") for w, s in CASES]
)
def test_resume_verdicts(resumed, writer, scenario, capsys):
    w = resumed[writer]
    if isinstance(w, str):
        pytest.skip(w)
    if w.outcomes[scenario] != "ok":
        pytest.skip(f"{writer.label} cannot write {scenario}: {w.outcomes[scenario][-300:]}")
    code, report = audit_json(w.out / scenario, capsys)
    checks = {c["check"]: c for c in report["checks"]}
    assert report["iteration"] == 2, report
    for check, (verdict, bug) in expected(writer, scenario).items():
        got = checks[check]
        assert got["verdict"] == verdict, got
        assert bug in got["summary"], got
        if verdict == DAMAGED:
            assert got["details"] and got["what_to_do"], got
    assert code == (1 if any(c["verdict"] == DAMAGED for c in checks.values()) else 0)
    code_text, out, err = run_audit(w.out / scenario, capsys=capsys)
    assert code_text == code and err == "" and "Traceback" not in out
    assert sum(1 for line in out.splitlines() if line.startswith("    what to do: ")) == sum(
        1 for c in checks.values() if c["verdict"] != OK
    )
