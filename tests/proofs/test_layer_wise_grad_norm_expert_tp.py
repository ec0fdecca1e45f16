"""Proof of patch layer-wise-grad-norm-expert-tp (upstream #6099): the layer-wise distributed
optimizer counts every expert's bias in the grad norm and the zero count.

``LayerWiseDistributedOptimizer`` (Muon's distributed optimizer) wraps its child optimizers
itself, so they carry no tensor-parallel groups: their grad-norm filter falls back to the
tensor-parallel rank for every param, and its own zero count passes no group either. With
``--expert-model-parallel-size 2 --tensor-model-parallel-size 2`` (expert tensor-parallel size
1) each expert's replicated fc2 bias is then dropped on tensor-parallel rank 1 (4.0 reads
2.83). The fix hands the children the tensor-parallel and expert tensor-parallel groups and
passes them to the zero count; before 0.19 it needs #5916 (grad-norm-expert-tp) underneath.

Real objects: MCore's ColumnParallelLinear / RowParallelLinear (dense) and SequentialMLP (the
local experts), DistributedDataParallel, LayerWiseDistributedOptimizer with bf16 (its children
wrapped in Float16OptimizerWithFloat16Params by it) and its step with gradient clipping and
zero counting, in a forked gloo world of 2 ranks (tensor-parallel 2, expert-parallel 2). torch
Adam stands in for Muon as the child's update rule (the emerging-optimizers package is not
installed here; the grad norm and zero count do not read the update rule). Disclosed stand-in:
``CudaOnCpu`` (CUDA placement and type names on the CPU).
"""

from __future__ import annotations

import megatron.core.distributed  # noqa: F401 - imported once, before the ranks fork
import megatron.core.optimizer  # noqa: F401
import megatron.core.transformer.moe.experts  # noqa: F401
import pytest
import torch
from _support import (
    DenseAndExperts,
    check,
    check_grad_stats,
    expert_config,
    init_tp2_ep2,
    mpu_process_groups,
    run_world,
)


def _build():
    """The model in DDP and a layer-wise optimizer over one child: dense params in one group,
    expert params in another, marked as the optimizer factory marks them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    config = expert_config(bf16=True, params_dtype=torch.bfloat16)
    model = DenseAndExperts(config)
    DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    named = list(model.named_parameters())
    group = dict(wd_mult=1.0, lr_mult=1.0, is_decoupled_lr=False)
    child = torch.optim.Adam(
        [
            {"params": [p for n, p in named if not n.startswith("experts.")], **group},
            {
                "params": [p for n, p in named if n.startswith("experts.")],
                **group,
                "is_expert_parallel": True,
            },
        ],
        lr=1e-3,
    )
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0, log_num_zeros_in_grad=True
    )
    return model, LayerWiseDistributedOptimizer([child], opt_config, mpu_process_groups())


def case_expert_biases_only() -> None:
    """Ones in each expert's fc2 bias (8 elements, one expert per rank), nothing else: the
    norm is 4.0 (the bug: 2.83)."""
    model, optimizer = _build()
    check_grad_stats(model, optimizer, expert_biases_only=True)


def case_all_grads() -> None:
    model, optimizer = _build()
    check_grad_stats(model, optimizer)


CASES = {"expert_biases_only": case_expert_biases_only, "all_grads": case_all_grads}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict[str, str]]:
    return run_world(CASES, 2, tmp_path_factory.mktemp("w2"), init=init_tp2_ep2)


@pytest.mark.parametrize("case", CASES)
def test_layer_wise_grad_norm_expert_tp(world, case) -> None:
    check(world, case)
