"""`audit`: does a Megatron checkpoint carry the damage of the bugs this series fixes?

One verdict per check: `ok`, `damaged` (with the evidence) or `cannot tell` (and why).

- loss-scale (chained-loss-scale, mimo-loss-scale): every dynamic loss scaler the checkpoint
  saved (dense and expert chains of a ChainedOptimizer, MIMO module optimizers) must hold the
  same (scale, growth_tracker, hysteresis_tracker); unpatched MCore lets them diverge.
- param-index (the distopt-* fix): which DistributedOptimizer param index wrote the state. The
  layout record where the checkpoint has one; otherwise from values: the main param of a
  16-bit param, cast to the model dtype, is its model weight, and an fp32 param's main param
  is its weight. So each saved main param is located among the saved model weights: under its
  own param (storage order, or a group already aligned), under another param (the
  grad-buffer-order index of unpatched MCore), both (values coincide) or none.
- reshard-padding (upstream #5077): `fully_reshardable` saves of a model spanning several
  buckets read every param past the first bucket from a shifted offset and pad the last ones
  with zeros: saved main params equal their weights shifted, or end in a run of exact zeros
  (so do exp_avg and exp_avg_sq).
- param-groups, step (upstream #4705, #5213, #5976, fix 2's per-param step): what a resume
  leaves in the optimizer (resume.py).

Modules: ckptread (the hostile-input-safe reader of pickles and torch_dist files), locate (main
params among model weights), reader (what a checkpoint holds: its View), one module per check
family (loss_scale, param_index, resume), loading (what stock does on load, where
established), report (verdicts and the report). Nothing here imports torch, megatron or the
series tooling.

Reading is lazy and windowed (ckptread, locate) and needs numpy, not torch: the peak memory
is a few windows plus a fingerprint table of the model weights (20 bytes per 64 elements, 80
MiB at most), whatever the checkpoint's size.
"""

from __future__ import annotations

from pathlib import Path

from .ckptread import BadCheckpoint, Files
from .loading import established
from .loss_scale import check_loss_scale
from .param_index import Audit, check_param_index, check_reshard_padding
from .reader import read_view, resolve
from .report import CANNOT_TELL, DAMAGED, OK, Report, Verdict
from .resume import check_param_groups, check_step

__all__ = ["CANNOT_TELL", "DAMAGED", "OK", "Report", "Verdict", "audit", "read_view", "resolve"]

# What values of a kind Megatron never writes raise where a check meets them
MALFORMED = (RecursionError, ValueError, OverflowError, TypeError, AttributeError, LookupError)


def audit(path: Path) -> Report:
    """Audit the checkpoint at `path` (read-only); UserError for bad input."""
    files = Files()
    try:
        view = read_view(path, files)
        a = Audit(view)
        verdicts = [
            check_loss_scale(view),
            check_param_index(a),
            check_reshard_padding(a),
            check_param_groups(a),
            check_step(a),
        ]
        for v in verdicts:
            established(a, v)
        return Report(view.path, view.kind, view.iteration, view.note, verdicts)
    except MALFORMED as exc:  # met past the reader's checks: still one line
        why = f"{type(exc).__name__}: {str(exc)[:200]}"
        raise BadCheckpoint(f"{path}: not a checkpoint Megatron writes ({why})") from None
    finally:
        files.close()
