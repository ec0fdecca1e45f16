"""What stock megatron-core does on load, said only where it was established."""

from __future__ import annotations

from .param_index import Audit
from .reader import View
from .report import Verdict, _names, _where
from .resume import param_groups

# Formats that do not carry torch Adam's per-param "step": stock megatron-core (every release,
# main, dev) fails to load them with torch Adam (fix 2, distopt-missing-state-key)
STEPLESS = ("fully_reshardable", "fully_sharded_model_space", "dp_zero_gather_scatter", "legacy")
FAILS = ("fails", "refuses")


def optimizer_flavour(view: View) -> str | None:
    """ "torch Adam" or "FusedAdam" (Transformer Engine, apex), from the saved param groups'
    keys (torch's optimizers save `foreach`/`differentiable`, the fused ones
    `bias_correction`); None where no group says."""
    for found in param_groups(view.objects, _where):
        keys = set().union(*(g.keys() for g in found.groups))
        if {"foreach", "differentiable"} & keys:
            return "torch Adam"
        if "bias_correction" in keys:
            return "FusedAdam"
    return None


def established(a: Audit, v: Verdict) -> None:
    """What stock does on load, said only where it was established for this optimizer flavour
    and format: with torch Adam the step-less formats fail on stock (its own checkpoints too);
    with an optimizer the checkpoint does not name, a claim that it loads is left out."""
    if not v.stock or v.stock.startswith(FAILS):
        return
    flavour = optimizer_flavour(a.view)
    stepless = sorted(set(a.formats) & set(STEPLESS))
    v.evidence.setdefault("optimizer", flavour)
    if flavour == "torch Adam" and stepless:
        v.stock = (
            f"fails to load it with torch Adam (KeyError: 'step': {_names(stepless)} saves no "
            "per-param step; so do its own checkpoints of this format)"
        )
    elif flavour is None:
        v.stock = ""
