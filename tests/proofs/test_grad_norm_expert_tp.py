"""Proof of patch grad-norm-expert-tp (upstream #5916): with expert parallelism and tensor
parallelism, the grad norm counts every expert's gradients once; expert grads are reduced over
the expert data-parallel group wherever expert tensor parallelism differs from tensor
parallelism.

The grad norm filters out gradients that tensor-parallel ranks hold as duplicates: a param that
is not split over tensor parallelism counts on tensor-parallel rank 0 only. Expert params are
laid out over the expert tensor-parallel group, not the tensor-parallel one: with
``--expert-model-parallel-size 2 --tensor-model-parallel-size 2`` (expert tensor-parallel
size 1) the two tensor-parallel ranks hold different experts, and a replicated expert param
(the bias of each expert's second linear layer) is dropped on tensor-parallel rank 1: the norm
misses those experts' biases (4.0 reads 2.83) and clipping is too weak; the zero count misses
them too. The fix filters expert params (``allreduce=False``) over the expert tensor-parallel
group. Without expert parallelism (``--expert-tensor-parallel-size 1`` under tensor-parallel
size 2) the experts were not marked as expert params at all: DDP reduced their grads over the
data-parallel group (each rank alone here) instead of the expert data-parallel one (both).

Real objects: MCore's ColumnParallelLinear / RowParallelLinear (dense) and SequentialMLP (the
local experts), DistributedDataParallel and its grad reduction, get_megatron_optimizer (torch
Adam or SGD: the dense and expert optimizers chained) and its step with gradient clipping and
zero counting, in forked gloo worlds of 2 ranks. Grads are written where backward would put
them (``main_grad``); the true norm is computed here from the model's structure: every rank's
dense shards and experts once, the replicated dense bias once. Disclosed stand-ins:
``CudaOnCpu`` (CUDA placement and type names on the CPU) and ``CudaStreamsOnCpu`` (CUDA
streams as in-order no-ops) for DDP's reduction.
"""

from __future__ import annotations

import megatron.core.distributed  # noqa: F401 - imported once, before the ranks fork
import megatron.core.optimizer  # noqa: F401
import megatron.core.transformer.moe.experts  # noqa: F401
import pytest
import torch
import torch.distributed as dist
from _support import (
    CudaStreamsOnCpu,
    DenseAndExperts,
    check,
    check_grad_stats,
    expert_config,
    init_tp2_ep2,
    init_tp2_etp1,
    run_world,
)


def _build(optimizer: str, distributed: bool, bf16: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = expert_config(bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)
    model = DenseAndExperts(config)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model
    )
    opt_config = OptimizerConfig(
        optimizer=optimizer,
        lr=1e-3,
        bf16=bf16,
        use_distributed_optimizer=distributed,
        clip_grad=1.0,
        log_num_zeros_in_grad=True,
    )
    return model, ddp, get_megatron_optimizer(opt_config, [ddp])


def _check(optimizer: str, distributed: bool, bf16: bool, expert_biases_only=False) -> None:
    model, _, opt = _build(optimizer, distributed, bf16)
    check_grad_stats(model, opt, expert_biases_only)


def case_expert_biases_only() -> None:
    """Ones in each expert's fc2 bias (8 elements, one expert per rank), nothing else: the
    norm is 4.0 (the bug: 2.83)."""
    _check("adam", distributed=True, bf16=True, expert_biases_only=True)


def case_distributed_optimizer_bf16() -> None:
    _check("adam", distributed=True, bf16=True)


def case_bf16_optimizer() -> None:
    _check("adam", distributed=False, bf16=True)


def case_fp32_optimizer() -> None:
    _check("sgd", distributed=False, bf16=False)


def case_expert_grads_reduced_over_expert_data_parallel() -> None:
    """Without expert parallelism, an expert tensor-parallel size (1) other than the
    tensor-parallel size (2) makes both ranks hold the same experts: DDP must reduce their
    grads over the expert data-parallel group (both ranks), not the data-parallel one (each rank
    alone). Per-token loss and no averaging in the collective: the reduction is a sum."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = expert_config(
        expert_model_parallel_size=1, calculate_per_token_loss=True, add_bias_linear=False
    )
    model = DenseAndExperts(config)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=False, average_in_collective=False
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    for p in model.parameters():
        p.main_grad.fill_(float(2 ** dist.get_rank()))
    with CudaStreamsOnCpu():
        ddp.finish_grad_sync()
    wrong = {
        float(p.main_grad.flatten()[0])
        for n, p in model.named_parameters()
        if n.startswith("experts.") and not torch.all(p.main_grad == 3.0)
    }
    assert not wrong, (
        f"expert grads after the reduction: {sorted(wrong)}, not 3.0 (2^rank summed over both "
        "ranks)"
    )


CASES = {
    "expert_biases_only": case_expert_biases_only,
    "distributed_optimizer_bf16": case_distributed_optimizer_bf16,
    "bf16_optimizer": case_bf16_optimizer,
    "fp32_optimizer": case_fp32_optimizer,
}


SYNC_CASES = {
    "expert_grads_reduced_over_expert_data_parallel": (
        case_expert_grads_reduced_over_expert_data_parallel
    ),
}


def _expert_biases_supported() -> bool:
    """MoE layers take biases from 0.15 on (before: ``Bias is not supported for MoE``)."""
    try:
        expert_config()
    except AssertionError as e:
        if "Bias is not supported for MoE" in str(e):
            return False
        raise
    return True


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[str, list[dict[str, str]]]:
    found = {"etp1": run_world(SYNC_CASES, 2, tmp_path_factory.mktemp("etp1"), init=init_tp2_etp1)}
    if _expert_biases_supported():
        found["ep2"] = run_world(CASES, 2, tmp_path_factory.mktemp("ep2"), init=init_tp2_ep2)
    return found


@pytest.mark.parametrize("case", CASES)
def test_grad_norm_expert_tp(worlds, case) -> None:
    if "ep2" not in worlds:
        pytest.skip(
            "no expert biases in this release (Bias is not supported for MoE): no expert param "
            "is replicated over expert tensor parallelism"
        )
    check(worlds["ep2"], case)


@pytest.mark.parametrize("case", SYNC_CASES)
def test_expert_grad_sync(worlds, case) -> None:
    check(worlds["etp1"], case)
