"""Proof of decoupled-grad-reader: gradients are written and read where the optimizer reads.

TE's FusedAdam reads `param.decoupled_grad` iff its `use_decoupled_grad` is set and skips
parameters whose gradient there is None; get_megatron_optimizer sets it at construction and,
for Megatron-FSDP, afterwards. Grad norm, clipping, zero counting and DistributedOptimizer's
copy into main grads decided from the config instead (from 0.18 with a Megatron-FSDP heuristic
on `params[0]`): wherever that differs from the optimizer the norm is 0, nothing is clipped,
gradients land where the optimizer does not read, or a rank without parameters fails.

Real MCore objects: FP32Optimizer, ChainedOptimizer, DistributedOptimizer (real DDP) and
FullyShardedOptimizer, in forked gloo worlds of 1 and 2. Stand-ins, outside the code under
test: TE's FusedAdam (tests/multigpu/te_standin.py, its documented contract), the CUDA shim.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from _support import (
    MultiTensorContract,
    build_distopt,
    check,
    fsdp_ddp_config,
    init_model_parallel,
    load_te_standin,
    precision_aware_config,
    run_world,
)
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

te_standin = load_te_standin()


def _norm(tensors) -> float:
    return math.sqrt(sum(float(getattr(t, "_local_tensor", t).square().sum()) for t in tensors))


def _params_with_grads(attr: str, count: int = 2) -> tuple[list, list]:
    params = [torch.nn.Parameter(torch.randn(6)) for _ in range(count)]
    grads = []
    for param in params:
        grad = torch.rand(6) + 0.5
        grad[0] = 0.0
        setattr(param, attr, grad)
        grads.append(grad)
    return params, grads


def _readers_follow_the_optimizer() -> None:
    """The wrapped optimizer says `use_decoupled_grad` (as FusedAdam does): readers follow."""
    params, grads = _params_with_grads("decoupled_grad")
    adam = torch.optim.Adam(params, lr=1e-2)
    adam.use_decoupled_grad = True  # what get_megatron_optimizer sets for Megatron-FSDP
    optimizer = FP32Optimizer(adam, OptimizerConfig(optimizer="adam", clip_grad=0.5), None)
    chained = ChainedOptimizer([optimizer])
    expected = _norm(grads)
    assert math.isclose(optimizer.get_grad_norm(), expected, rel_tol=1e-5), "grad norm"
    assert math.isclose(chained.get_grad_norm(), expected, rel_tol=1e-5), "chained grad norm"
    assert optimizer.count_zeros() == len(grads), "zeros"
    assert chained.count_zeros() == len(grads), "chained zeros"
    with MultiTensorContract():
        assert math.isclose(optimizer.clip_grad_norm(0.5), expected, rel_tol=1e-5)
    assert math.isclose(_norm(grads), 0.5, rel_tol=1e-4), "clipping did not scale"


def _copy_into_main_grads_follows_the_optimizer() -> None:
    """DistributedOptimizer (real DDP) copies main grads where its optimizer reads."""
    chunks, _, opts = build_distopt([torch.nn.Linear(8, 8)], bf16=False)
    distopt = opts[0]
    distopt.optimizer.use_decoupled_grad = True
    for param in chunks[0].module.parameters():
        param.main_grad.copy_(torch.rand_like(param) + 0.5)
    distopt.prepare_grads()
    main_params = distopt.get_parameters()
    assert main_params, "this rank holds no shard"
    where = [
        (p.grad is not None, getattr(p, "decoupled_grad", None) is not None) for p in main_params
    ]
    assert where == [(False, True)] * len(main_params), f"(grad, decoupled_grad) set: {where}"


class _DuckOptimizer:
    """A chained child that is not a MegatronOptimizer (as upstream's own tests chain)."""

    def __init__(self, params, config) -> None:
        self.params, self.config = params, config
        self.param_groups = [{"params": params}]

    def get_parameters(self):
        return self.params

    def get_grad_stats_parallel_group(self):
        return parallel_state.get_model_parallel_group()

    def get_grads_for_grad_norm(self, grad_norm_group=None):
        return [p.grad for p in self.params]

    get_main_grads_for_grad_norm = get_grads_for_grad_norm  # its name before core_v0.19


def _duck_typed_children() -> None:
    """Compatibility: chained children without MegatronOptimizer's methods still work."""
    config = OptimizerConfig()
    params, grads = _params_with_grads("grad", count=4)
    chained = ChainedOptimizer(
        [_DuckOptimizer(params[:2], config), _DuckOptimizer(params[2:], config)]
    )
    assert chained.count_zeros() == len(grads)
    assert math.isclose(chained.get_grad_norm(), _norm(grads), rel_tol=1e-5)


def _mfsdp_v2_readers_follow_fused_adam() -> None:
    """Megatron-FSDP v2 builds FusedAdam to read param.grad: the grad norm reads it too."""
    try:
        from megatron.core.optimizer.fully_sharded_optimizer import FullyShardedOptimizer
    except ImportError:
        return  # no Megatron-FSDP v2 optimizer in this baseline
    config = precision_aware_config(use_distributed_optimizer=False, clip_grad=0.5)

    class _V2Chunk(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ddp_config = fsdp_ddp_config(
                megatron_fsdp_version=2, use_distributed_optimizer=False
            )
            self.weight = torch.nn.Parameter(torch.randn(4, 3))

    chunk = _V2Chunk()
    adam = te_standin.FusedAdamStandIn([chunk.weight], lr=1e-2)
    optimizer = FullyShardedOptimizer(adam, config, None, lambda opt, config=None: None, [chunk])
    chunk.weight.grad = torch.rand(4, 3) + 0.5
    chunk.weight.grad.view(-1)[:3] = 0.0
    expected = float(torch.linalg.vector_norm(chunk.weight.grad))
    grad_norm = float(optimizer.get_grad_norm())
    assert math.isclose(grad_norm, expected, rel_tol=1e-5), f"grad norm {grad_norm}"
    assert optimizer.count_zeros() == 3


@contextmanager
def _recorded_all_reduces() -> Iterator[list]:
    """``torch.distributed.all_reduce`` calls recorded, not run: a rank that fails or issues
    more of them than another would hang the real ones; the counts are compared afterwards."""
    calls: list = []
    original = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: calls.append(kwargs.get("group"))
    try:
        yield calls
    finally:
        dist.all_reduce = original


def _chain_count_zeros_on_a_rank_without_parameters() -> None:
    """ChainedOptimizer.count_zeros with a precision-aware MXFP8 config: the optimizer owns
    parameters on pipeline stage 0 only (a stub on stage 1, as MCore builds for a module a
    stage does not hold) and reads param.decoupled_grad, as FusedAdam under Megatron-FSDP.
    Every rank makes the one reduction and the zeros are counted where the optimizer reads;
    the config's guess read param.grad (no zero counted) and took `params[0]` of an empty
    list on stage 1 (IndexError)."""
    config = precision_aware_config(fp8_recipe="mxfp8")
    params, grads = _params_with_grads("decoupled_grad")
    owns = parallel_state.get_pipeline_model_parallel_rank() == 0
    adam = te_standin.FusedAdamStandIn(params, lr=1e-2, use_decoupled_grad=True) if owns else None
    chained = ChainedOptimizer([FP32Optimizer(adam, config, None)])
    failure = ""
    with _recorded_all_reduces() as calls:
        try:
            chained.count_zeros()
        except Exception as error:  # noqa: BLE001 - compared across ranks below
            failure = repr(error)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (len(calls), failure))
    assert per_rank == [(1, "")] * len(per_rank), f"(all_reduce calls, failure) per rank {per_rank}"
    num_zeros = chained.count_zeros()
    assert num_zeros == len(grads), f"{num_zeros} zeros counted, expected {len(grads)}"


def _init_two_stages() -> None:
    """``init`` for a world of 2: two pipeline stages, one model-parallel (grad-stats) group."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    torch.manual_seed(1234)


_CASES = {
    "readers_follow_the_optimizer": _readers_follow_the_optimizer,
    "copy_into_main_grads_follows_the_optimizer": _copy_into_main_grads_follows_the_optimizer,
    "duck_typed_children": _duck_typed_children,
    "mfsdp_v2_readers_follow_fused_adam": _mfsdp_v2_readers_follow_fused_adam,
}

_TWO_RANK_CASES = {
    "chain_count_zeros_on_a_rank_without_parameters": (
        _chain_count_zeros_on_a_rank_without_parameters
    )
}

# world size -> (its cases, the init of each rank)
_WORLDS = {1: (_CASES, init_model_parallel), 2: (_TWO_RANK_CASES, _init_two_stages)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """world size -> per rank, case -> outcome; each world forked once, when first asked for."""
    worlds: dict[int, list[dict[str, str]]] = {}

    def of_world(world_size: int) -> list[dict[str, str]]:
        if world_size not in worlds:
            cases, init = _WORLDS[world_size]
            out = tmp_path_factory.mktemp(f"reader{world_size}")
            worlds[world_size] = run_world(cases, world_size=world_size, out=out, init=init)
        return worlds[world_size]

    return of_world


@pytest.mark.parametrize(
    ("world_size", "case"), [(size, case) for size, (cases, _) in _WORLDS.items() for case in cases]
)
def test_reader(results, world_size, case):
    check(results(world_size), case)
