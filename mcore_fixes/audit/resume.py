"""param-groups and step: what a resume leaves in the optimizer: param groups and step counts.

- param-groups (upstream #4705, #5213): the saved optimizer param groups against what the run's
  saved args and LR/WD scheduler state say they must be. MCore builds one group per distinct
  setting, so two groups with every setting equal hold another group's (a resume that paired
  saved and current groups by keys that do not hold their LR bounds: #4705); a group on the
  default LR schedule runs between the scheduler's bounds (a resume with
  --override-opt-param-scheduler that kept the saved ones: #5213); each group's weight decay
  is its wd_mult times the scheduler's at the saved step; where the groups list their params,
  each param is in exactly one.
- step (upstream #5976, fix 2's per-param step): Adam's step count of every param is at most
  the iterations trained (fewer where FP16 skipped steps, or the optimizer was reset), and the
  same for every param of one optimizer.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .ckptread import LazyTensor, Opaque, walk
from .param_index import Audit
from .report import CANNOT_TELL, DAMAGED, OK, Verdict, _names, _where

# What tells param groups apart (ParamGroupOverride's keys and MCore's structural flags)
SETTINGS = (
    "max_lr",
    "min_lr",
    "start_wd",
    "end_wd",
    "wd_mult",
    "lr_mult",
    "is_expert_parallel",
    "is_decoupled_lr",
    "default_config",
    "optimizer",
)
REL = 1e-6  # float tolerance of recomputed schedule values
_FLAT_GROUP = re.compile(r"^(?P<opt>.*?)param_groups\.(?P<i>[0-9]{1,6})\.(?P<key>[^.]+)$")


@dataclass
class Groups:
    where: str
    groups: list[dict]


def _number(value: Any) -> float | None:
    if isinstance(value, LazyTensor):
        return value.item() if value.numel == 1 else None
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)) and math.isfinite(float(value)):
        return float(value)
    return None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b), 1e-12)


def _setting(group: dict, key: str) -> Any:
    value = group.get(key, group.get(f"pre_{key}"))
    number = _number(value)
    return number if number is not None else value if isinstance(value, (str, bool)) else None


def param_groups(objects: list[tuple[str, Any]], place) -> list[Groups]:
    """Every saved list of optimizer param groups (one per optimizer)."""
    found = []
    for where, obj in objects:
        for path, value in walk(obj):
            if (
                path
                and path[-1] == "param_groups"
                and isinstance(value, list)
                and value
                and all(isinstance(g, dict) for g in value)
            ):
                found.append(Groups(place(where, path[:-1]), value))
    # torch DCP (fsdp_dtensor) saves each setting of a group as an object of its own:
    # "optimizer.param_groups.0.lr"
    flat: dict[str, dict[int, dict]] = {}
    for where, obj in objects:
        m = _FLAT_GROUP.match(where)
        if m and len(flat) < 64 and int(m["i"]) < 4096:
            flat.setdefault(m["opt"], {}).setdefault(int(m["i"]), {})[m["key"]] = obj
    for opt, groups in flat.items():
        found.append(Groups(f"{opt}param_groups", [groups[i] for i in sorted(groups)]))
    return found


def scheduler_state(objects: list[tuple[str, Any]]) -> dict | None:
    for where, obj in objects:
        if where in ("common_state", "common.pt") or where.endswith("model_optim_rng.pt"):
            state = obj.get("opt_param_scheduler") if isinstance(obj, dict) else None
            if isinstance(state, dict):
                return state
    return None


def scheduled_wd(sched: dict, group: dict) -> float | None:
    """Weight decay the scheduler sets at its saved step (megatron.core's get_wd)."""
    steps = _number(sched.get("num_steps", sched.get("num_iters")))
    start = _number(group.get("start_wd", sched.get("start_wd")))
    end = _number(group.get("end_wd", sched.get("end_wd")))
    incr = _number(sched.get("wd_incr_steps"))
    style = sched.get("wd_incr_style")
    if None in (steps, start, end) or not isinstance(style, str):
        return None
    if style == "constant" or (incr is not None and steps > incr):
        return end
    if not incr or style not in ("linear", "cosine"):
        return None
    ratio = steps / incr
    coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    return start + coeff * (end - start)


def _label(i: int, group: dict) -> str:
    bounds = [f"{k} {_setting(group, k):g}" for k in ("max_lr", "min_lr") if _number(group.get(k))]
    wd = _number(group.get("wd_mult"))
    return f"group {i} ({', '.join(bounds + ([f'wd_mult {wd:g}'] if wd is not None else []))})"


def group_findings(found: Groups, sched: dict | None, args: Any) -> dict[str, list[str]]:
    """What is wrong with one optimizer's groups: {kind: [evidence lines]}."""
    groups, where = found.groups, found.where
    out: dict[str, list[str]] = {"duplicate": [], "bounds": [], "weight_decay": [], "params": []}
    keys = [tuple((k, _setting(g, k)) for k in SETTINGS) for g in groups]
    if any(_number(g.get("max_lr")) is not None for g in groups):
        for key, n in Counter(keys).items():
            if n > 1:
                same = [i for i, k in enumerate(keys) if k == key]
                out["duplicate"].append(
                    f"{where}: groups {', '.join(map(str, same))} have every setting equal "
                    f"({_label(same[0], groups[same[0]])})"
                )
    if sched is not None:
        bounds = (_number(sched.get("max_lr")), _number(sched.get("min_lr")))
        for i, g in enumerate(groups):
            default = g.get("default_config")
            if default is None:  # before default_config: groups without an LR override
                default = g.get("is_decoupled_lr") is False and _setting(g, "lr_mult") == 1.0
            own = (_number(g.get("max_lr")), _number(g.get("min_lr")))
            if default is True and None not in own and None not in bounds:
                if not all(_close(a, b) for a, b in zip(own, bounds, strict=True)):
                    out["bounds"].append(
                        f"{where}: {_label(i, g)} is on the default LR schedule, whose bounds "
                        f"are max_lr {bounds[0]:g}, min_lr {bounds[1]:g} (scheduler state)"
                    )
            wd, mult = _number(g.get("weight_decay")), _number(g.get("wd_mult"))
            expected = scheduled_wd(sched, g)
            if None not in (wd, mult, expected) and not _close(wd, expected * mult):
                out["weight_decay"].append(
                    f"{where}: {_label(i, g)} has weight_decay {wd:g}, the scheduler's "
                    f"{expected:g} x wd_mult is {expected * mult:g}"
                )
    lists = [g.get("params") for g in groups]
    if all(isinstance(p, list) and all(isinstance(x, int) for x in p) for p in lists):
        seen = Counter(x for p in lists for x in p)
        twice = sorted(x for x, n in seen.items() if n > 1)
        # indices 0..n-1 of the optimizer's params: those below the highest that no group
        # lists (an index far past the number listed is no param index: nothing to say)
        top = max(seen, default=-1)
        none = sorted(set(range(top + 1)) - set(seen)) if 0 <= top < 2 * len(seen) + 1024 else []
        if twice:
            out["params"].append(f"{where}: params {_ints(twice)} are in two groups")
        if none:
            out["params"].append(f"{where}: params {_ints(none)} are in no group")
    return {k: v for k, v in out.items() if v}


def _ints(items: list[int], shown: int = 8) -> str:
    head = ", ".join(map(str, items[:shown]))
    return head + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _arg(args: Any, name: str) -> Any:
    return args.get(name) if isinstance(args, Opaque) else None


# --- step counts --------------------------------------------------------------------------


def step_counts(objects: list[tuple[str, Any]], regions: list, place) -> list[tuple[str, float]]:
    """(where, step) of every saved optimizer step count: per group (DistributedOptimizer),
    per param (torch Adam's state), shared (common_step), per tensor (model space)."""
    found = []
    for where, obj in objects:
        for path, value in walk(obj):
            if not path or path[-1] not in ("step", "common_step"):
                continue
            parents = {p for p in path if isinstance(p, str)}
            if not parents & {"param_groups", "state", "optimizer"}:
                continue
            number = _number(value)
            if number is not None:
                found.append((place(where, path), number))
    for region in regions:
        step = region.state == "step" or region.key.rsplit(".", 1)[-1] == "step"
        if step and region.source.numel == 1:
            where = region.owner or region.buffer or f"optimizer.state.{region.state}.{region.key}"
            found.append((f"{region.optimizer}.{where}".lstrip("."), region.source.item()))
    return found


# --- param groups and step counts (what a resume leaves) ------------------------------------

GROUPS_TODO = (
    "resume from the last checkpoint saved before the first resume of this run (its groups are "
    "right) on megatron-core 0.19.0 or later, or the fork built on 0.19 (#4705 pairs the groups "
    "by their LR bounds too); this checkpoint's weights and moments are its own, its group "
    "settings are not (--no-load-optim keeps the weights only). The fork does not repair them."
)
OVERRIDE_TODO = (
    "the groups train at the earlier run's LR bounds, not your --lr/--min-lr: resume on a "
    "megatron-core with upstream #5213 (upstream dev) with --override-opt-param-scheduler, which "
    "sets them from the args; without #5213 no flag changes them (the fork does not carry it)."
)


def check_param_groups(a: Audit) -> Verdict:
    name, view = "param-groups", a.view
    found = param_groups(view.objects, _where)
    sched = scheduler_state(view.objects)
    args = a.rec.args
    evidence: dict[str, Any] = {"optimizers": len(found), "scheduler": sched}
    if not found:
        return Verdict(name, OK, "no optimizer param groups saved.", evidence)
    findings: dict[str, list[str]] = {}
    for groups in found:
        for kind, lines in group_findings(groups, sched, args).items():
            findings.setdefault(kind, []).extend(lines)
    evidence.update(findings)
    override = bool(args.get("override_opt_param_scheduler")) if isinstance(args, Opaque) else False
    if not findings:
        what = "LR bounds, weight decay and params" if sched else "settings and params"
        src = "the saved scheduler state" if sched else "each other (no scheduler state saved)"
        return Verdict(
            name,
            OK,
            f"{sum(len(g.groups) for g in found)} param group(s) of {len(found)} optimizer(s): "
            f"{what} agree with {src}.",
            evidence,
        )
    details = [line for lines in findings.values() for line in lines]
    if "duplicate" in findings or "params" in findings:
        return Verdict(
            name,
            DAMAGED,
            "param groups hold other groups' settings (upstream #4705: a resume of a run whose "
            "groups differ only in LR bounds, e.g. --decoupled-lr).",
            evidence,
            details=details,
            todo=GROUPS_TODO,
        )
    if "bounds" in findings and override:
        return Verdict(
            name,
            DAMAGED,
            "param groups kept LR bounds that the scheduler state and args replaced (upstream "
            "#5213: a resume with --override-opt-param-scheduler).",
            evidence,
            details=details,
            todo=OVERRIDE_TODO,
        )
    return Verdict(
        name,
        DAMAGED,
        "param groups disagree with the saved scheduler state (LR bounds or weight decay).",
        evidence,
        details=details,
        todo="check the args this run was resumed with; "
        + (OVERRIDE_TODO if "bounds" in findings else GROUPS_TODO),
    )


STEP_TODO = (
    "Adam's bias corrections run ahead: resume with the fork, which gives each param its own "
    "step on load but keeps the saved count (the count itself cannot be repaired), or from a "
    "checkpoint before the resume; --no-load-optim restarts the moments and the count."
)
FSDP_TODO = (
    "one update was taken before training (0.74x the first real update; with weight decay the "
    "weights moved before training): the count cannot be repaired; new runs with the fork or "
    "megatron-core with #5976 (upstream main) do not take it."
)


def check_step(a: Audit) -> Verdict:
    name, view = "step", a.view
    steps = step_counts(view.objects, view.regions, _where)
    it = view.iteration if isinstance(view.iteration, int) else None
    evidence: dict[str, Any] = {"iteration": it, "steps": dict(steps[:64]), "counts": len(steps)}
    if not steps:
        return Verdict(name, OK, "no optimizer step count saved (e.g. SGD).", evidence)
    values = sorted({s for _, s in steps})
    if it is None:
        return Verdict(
            name,
            CANNOT_TELL,
            f"step counts {_names([f'{v:g}' for v in values])}, but no iteration number saved.",
            evidence,
            todo="audit the iteration directory megatron/training wrote (iter_NNNNNNN).",
        )
    ahead = [(w, s) for w, s in steps if s > it]
    if not ahead:
        return Verdict(
            name,
            OK,
            f"{len(steps)} step count(s), at most the {it} iteration(s) trained "
            f"({_names([f'{v:g}' for v in values])}).",
            evidence,
        )
    details = [f"{w}: step {s:g}" for w, s in ahead]
    fsdp = (isinstance(a.rec.args, Opaque) and a.rec.args.get("use_megatron_fsdp")) or (
        "fsdp_dtensor" in a.formats
    )
    if all(s == it + 1 for _, s in ahead) and fsdp:
        return Verdict(
            name,
            DAMAGED,
            f"Adam's step count is {it + 1} after {it} iteration(s) (upstream #5976: "
            "Megatron-FSDP's fully_shard(model, optimizer) stepped once before training).",
            evidence,
            details=details,
            todo=FSDP_TODO,
        )
    return Verdict(
        name,
        DAMAGED,
        f"step counts up to {max(values):g} after {it} iteration(s): "
        + (
            "after a resume all params shared one step tensor, advanced once per param per "
            "iteration (distopt-mixed-precision-groups: each param's own step)."
            if a.formats
            else "a param in two param groups steps twice an iteration (upstream #4705: see "
            "param-groups)."
            if _in_two_groups(view)
            else "more optimizer steps than iterations."
        ),
        evidence,
        details=details,
        todo=STEP_TODO,
    )


def _in_two_groups(view) -> bool:
    """Whether a saved optimizer lists a param in two of its groups."""
    return any(
        "in two groups" in line
        for found in param_groups(view.objects, _where)
        for line in group_findings(found, None, None).get("params", [])
    )
