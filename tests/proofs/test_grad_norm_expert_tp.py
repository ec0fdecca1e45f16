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

import math

import megatron.core.distributed  # noqa: F401 - imported once, before the ranks fork
import megatron.core.optimizer  # noqa: F401
import megatron.core.transformer.moe.experts  # noqa: F401
import pytest
import torch
import torch.distributed as dist
from _support import CudaStreamsOnCpu, check, run_world

HIDDEN, FFN, EXPERTS = 8, 16, 2  # at expert-parallel size 2, one local expert per rank


def init_tp2_ep2() -> None:
    """``init``: tensor-parallel 2, expert-parallel 2, expert tensor-parallel 1 (world of 2)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
    )
    torch.manual_seed(5916)


def init_tp2_etp1() -> None:
    """``init``: tensor-parallel 2, no expert parallelism, expert tensor-parallel 1 (world of 2):
    both ranks hold the same experts, so expert data parallelism spans both."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=1, expert_tensor_parallel_size=1
    )
    torch.manual_seed(5916)


def _config(**kwargs):
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=4,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=FFN,
        moe_router_topk=2,
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        sequence_parallel=True,
        add_bias_linear=True,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
    )
    return TransformerConfig(**(fields | kwargs))


class DenseAndExperts(torch.nn.Module):
    """A dense column-parallel linear (weight and bias split over tensor parallelism), a dense
    row-parallel linear (its bias replicated on both tensor-parallel ranks) and this rank's
    local experts (SequentialMLP: fc1 column-parallel, fc2 row-parallel with a bias, over the
    expert tensor-parallel group)."""

    def __init__(self, config) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import SequentialMLP

        linear = dict(config=config, init_method=config.init_method, bias=True)
        self.dense_in = ColumnParallelLinear(HIDDEN, FFN, gather_output=False, **linear)
        self.dense_out = RowParallelLinear(
            FFN, HIDDEN, input_is_parallel=True, skip_bias_add=False, **linear
        )
        submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        local_experts = EXPERTS // config.expert_model_parallel_size
        self.experts = SequentialMLP(local_experts, config, submodules, _process_groups())
        self.dense_replicated = [self.dense_out.bias]
        if config.bf16:
            self.to(torch.bfloat16)


def _process_groups():
    """MCore's process groups, as MoE layers take them (ModelCommProcessGroups before 0.16)."""
    try:
        from megatron.core.process_groups_config import ProcessGroupCollection as Groups
    except ImportError:
        from megatron.core.process_groups_config import ModelCommProcessGroups as Groups
    return Groups.use_mpu_process_groups()


def _build(optimizer: str, distributed: bool, bf16: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = _config(bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)
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


def _expert_biases(model) -> list[torch.Tensor]:
    """This rank's experts' fc2 biases: replicated over expert tensor parallelism (size 1)."""
    return [
        p
        for n, p in model.named_parameters()
        if n.startswith("experts.") and n.endswith("linear_fc2.bias")
    ]


def _write_grads(model, expert_biases_only: bool) -> None:
    """Grads where backward puts them: seeded, other on every rank, one zero per param (for
    the zero count); the replicated dense bias equal on both ranks. ``expert_biases_only``:
    ones in the experts' fc2 biases, zeros elsewhere."""
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    replicated = torch.Generator().manual_seed(7)  # equal on both ranks, as after backward
    for p in model.parameters():
        if expert_biases_only:
            p.main_grad.fill_(1.0 if any(p is q for q in _expert_biases(model)) else 0.0)
            continue
        source = replicated if any(p is q for q in model.dense_replicated) else gen
        grad = torch.rand(p.shape, generator=source) + 0.5
        grad.view(-1)[0] = 0.0
        p.main_grad.copy_(grad)


def _true_stats(model) -> tuple[float, float, float]:
    """(norm, zeros, norm without tensor-parallel rank 1's expert biases) of the model's
    gradients, each logical gradient once: every rank's params (dense shards, its own experts),
    the replicated dense bias once."""
    sq, zeros, biases = 0.0, 0.0, 0.0
    for p in model.parameters():
        if any(p is q for q in model.dense_replicated) and dist.get_rank() != 0:
            continue
        g = p.main_grad.float()
        sq += float(g.square().sum())
        zeros += float((g == 0).sum())
        if dist.get_rank() == 1 and any(p is q for q in _expert_biases(model)):
            biases += float(g.square().sum())
    stats = torch.tensor([sq, zeros, biases], dtype=torch.float64)
    dist.all_reduce(stats)
    return math.sqrt(stats[0]), float(stats[1]), math.sqrt(stats[0] - stats[2])


def _check(optimizer: str, distributed: bool, bf16: bool, expert_biases_only=False) -> None:
    """One step of the optimizer (clipping, zero counting) on known grads: the grad norm and
    the zero count it reports are the model's."""
    model, _, opt = _build(optimizer, distributed, bf16)
    _write_grads(model, expert_biases_only)
    true_norm, true_zeros, without = _true_stats(model)
    _, grad_norm, num_zeros = opt.step()
    wrong = []
    if not math.isclose(float(grad_norm), true_norm, rel_tol=1e-4):
        wrong.append(
            f"grad norm {float(grad_norm):.4f}, true norm {true_norm:.4f} (without tensor-"
            f"parallel rank 1's expert biases: {without:.4f})"
        )
    if num_zeros != true_zeros:
        wrong.append(f"zeros counted {num_zeros}, true count {true_zeros:.0f}")
    assert not wrong, "; ".join(wrong)


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

    config = _config(expert_model_parallel_size=1, calculate_per_token_loss=True)
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


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[str, list[dict[str, str]]]:
    return {
        "ep2": run_world(CASES, 2, tmp_path_factory.mktemp("ep2"), init=init_tp2_ep2),
        "etp1": run_world(SYNC_CASES, 2, tmp_path_factory.mktemp("etp1"), init=init_tp2_etp1),
    }


@pytest.mark.parametrize("case", CASES)
def test_grad_norm_expert_tp(worlds, case) -> None:
    check(worlds["ep2"], case)


@pytest.mark.parametrize("case", SYNC_CASES)
def test_expert_grad_sync(worlds, case) -> None:
    check(worlds["etp1"], case)
