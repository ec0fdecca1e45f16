"""loss-scale: the dynamic loss scalers of one run must agree (moe-loss-scales,
mimo-loss-scales)."""

from __future__ import annotations

import math
from typing import Any

from .ckptread import LazyTensor, walk
from .reader import View
from .report import DAMAGED, OK, Verdict, _where


def _scale_value(value: Any) -> float | None:
    if isinstance(value, LazyTensor):
        return value.item() if value.numel >= 1 else None
    if isinstance(value, float) or (isinstance(value, int) and abs(value) < 2**64):
        return float(value)
    return None


def _tracker_value(value: Any) -> int | None:
    """A scaler's growth or hysteresis tracker as an int (None: not a count)."""
    number = _scale_value(value)
    return int(number) if number is not None and math.isfinite(number) else None


def _grad_scalers(view: View) -> list[tuple[str, tuple[float, int, int]]]:
    found = []
    for where, obj in view.objects:
        for path, value in walk(obj):
            if isinstance(value, dict) and {"scale", "growth_tracker", "hysteresis_tracker"} <= set(
                value
            ):
                scale = _scale_value(value["scale"])
                growth = _tracker_value(value["growth_tracker"])
                hysteresis = _tracker_value(value["hysteresis_tracker"])
                if scale is None or growth is None or hysteresis is None:
                    continue
                state = (scale, growth, hysteresis)
                found.append((_where(where, path), state))
    return found


def _fmt_scaler(state: tuple[float, int, int]) -> str:
    scale, growth, hysteresis = state
    return f"scale {scale:g}, growth_tracker {growth}, hysteresis_tracker {hysteresis}"


def check_loss_scale(view: View) -> Verdict:
    scalers = _grad_scalers(view)
    evidence = {
        "scalers": [
            {"where": w, "scale": s[0], "growth_tracker": s[1], "hysteresis_tracker": s[2]}
            for w, s in scalers
        ]
    }
    if not scalers:
        return Verdict(
            "loss-scale",
            OK,
            "no dynamic loss scaler saved (BF16/FP32 training or a "
            "constant loss scale): nothing can diverge.",
            evidence,
        )
    states = {s for _, s in scalers}
    if len(states) == 1:
        (state,) = states
        return Verdict(
            "loss-scale",
            OK,
            f"{len(scalers)} dynamic loss scaler(s), all at ({_fmt_scaler(state)}).",
            evidence,
        )
    scales = sorted({s[0] for s in states})
    return Verdict(
        "loss-scale",
        DAMAGED,
        f"{len(scalers)} dynamic loss scalers of one run differ (scales "
        f"{', '.join(f'{s:g}' for s in scales)}): each optimizer backed off on its own "
        "overflows (moe-loss-scales, mimo-loss-scales).",
        evidence,
        details=[f"{w}: {_fmt_scaler(s)}" for w, s in scalers]
        + ["gradients were unscaled by another scale than the loss was scaled with"],
        todo="resume with the fork: it reconciles the scalers (nothing else to do); the updates "
        "already taken with a wrong scale stay in the weights.",
        fork="reconciles them on load (a ChainedOptimizer) or at the first step (MIMO) to the "
        f"smallest scale ({scales[0]:g}), growth_tracker 0 and hysteresis reset, and warns once",
        stock="keeps them diverged",
    )
