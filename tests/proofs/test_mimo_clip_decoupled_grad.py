"""Proof of mimo-clip-decoupled-grad: MIMO clips where each module optimizer reads.

MimoOptimizer clipped `param.decoupled_grad` iff `config.use_precision_aware_optimizer`, while
TE's FusedAdam reads it iff its `use_decoupled_grad` is set, which it is not with MXFP8: the
global norm was computed, the gradients the optimizer steps on were left unclipped.

Real MCore: MimoOptimizer, FP32Optimizer, OptimizerConfig, clip_grads, in a forked gloo world
of 1. Stand-ins, outside the code under test: TE's FusedAdam (tests/multigpu/te_standin.py),
the CUDA shim.
"""

from __future__ import annotations

import math

import torch
from _support import (
    MultiTensorContract,
    check,
    init_model_parallel,
    load_te_standin,
    precision_aware_config,
    run_world,
)
from megatron.core.optimizer.optimizer import FP32Optimizer

te_standin = load_te_standin()


def _mimo_clips_where_its_optimizer_reads() -> None:
    """MIMO with a module optimizer that reads param.grad under a precision-aware config."""
    from megatron.core.models.mimo.optimizer import MimoOptimizer, ModuleOptimizerInfo

    config = precision_aware_config(clip_grad=0.5, fp8_recipe="mxfp8")  # FusedAdam reads .grad
    params = [torch.nn.Parameter(torch.randn(6)) for _ in range(2)]
    for param in params:
        param.grad = torch.rand(6) + 0.5
    adam = te_standin.FusedAdamStandIn(params, lr=1e-2, use_decoupled_grad=False)
    module = FP32Optimizer(adam, config, lambda opt, config=None: None)
    info = ModuleOptimizerInfo(optimizer=module, grid=None, pg_collection=None, is_active=True)
    mimo = MimoOptimizer({"llm": info}, config)
    with MultiTensorContract():
        success, grad_norm, _ = mimo.step()
    clipped = math.sqrt(sum(float(p.grad.square().sum()) for p in params))
    assert success and grad_norm > 0.5, (success, grad_norm)
    assert math.isclose(clipped, 0.5, rel_tol=1e-4), (
        f"grad norm {grad_norm} vs clip_grad 0.5: MIMO left the gradients unclipped ({clipped})"
    )


_CASES = {"mimo_clips_where_its_optimizer_reads": _mimo_clips_where_its_optimizer_reads}


def test_mimo_clips_where_its_optimizer_reads(tmp_path):
    results = run_world(_CASES, world_size=1, out=tmp_path, init=init_model_parallel)
    check(results, "mimo_clips_where_its_optimizer_reads")
