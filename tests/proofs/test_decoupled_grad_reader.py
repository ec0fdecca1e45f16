"""Proof of decoupled-grad-reader: every gradient reader asks the optimizer where it reads.

TE's FusedAdam reads `param.decoupled_grad` iff its `use_decoupled_grad` is set and skips
parameters whose gradient there is None; get_megatron_optimizer sets it for Megatron-FSDP v1
after construction. The readers guessed instead, each its own way: grad norm, clipping and
zero counting from `config.use_precision_aware_optimizer_no_fp8_or_ds_fp8` (plus an FSDP
heuristic on `params[0]` from 0.18), MIMO's clip from `config.use_precision_aware_optimizer`,
FP16 unscaling of the DistributedOptimizer from the config. Wherever the guess differs from the
optimizer, the norm is 0, nothing is clipped, or unscaling reads `None.data`.

Real MCore objects: FP32Optimizer, ChainedOptimizer, MimoOptimizer, DistributedOptimizer and
FullyShardedOptimizer, built by MCore's own constructors or get_megatron_optimizer, in a forked
gloo world. Stand-ins, all outside the code under test: TE's FusedAdam (tests/multigpu/
te_standin.py, its documented contract), the Megatron-FSDP v1 chunk of _support, the CUDA shim.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _support import (
    FsdpV1Chunk,
    MultiTensorContract,
    check,
    fsdp_ddp_config,
    init_model_parallel,
    load_te_standin,
    run_world,
)
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
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
    adam.use_decoupled_grad = True  # what get_megatron_optimizer sets for Megatron-FSDP v1
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


def _mimo_clips_where_its_optimizer_reads() -> None:
    """MIMO with a module optimizer that reads param.grad under a precision-aware config."""
    try:
        from megatron.core.models.mimo.optimizer import MimoOptimizer, ModuleOptimizerInfo
    except ImportError:
        return  # no MIMO before core_v0.17
    with te_standin.te_stand_in(te_modules=True):
        config = OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            clip_grad=0.5,
            use_distributed_optimizer=True,
            use_precision_aware_optimizer=True,
            fp8_recipe="mxfp8",  # FusedAdam then reads param.grad
        )
    params, grads = _params_with_grads("grad")
    adam = te_standin.FusedAdamStandIn(params, lr=1e-2, use_decoupled_grad=False)
    module = FP32Optimizer(adam, config, lambda opt, config=None: None)
    info = ModuleOptimizerInfo(optimizer=module, grid=None, pg_collection=None, is_active=True)
    mimo = MimoOptimizer({"llm": info}, config)
    with MultiTensorContract():
        success, grad_norm, _ = mimo.step()
    assert success and grad_norm > 0.5, (success, grad_norm)
    assert math.isclose(_norm(grads), 0.5, rel_tol=1e-4), (
        f"grad norm {grad_norm} vs clip_grad 0.5: MIMO left the gradients unclipped "
        f"(norm {_norm(grads)})"
    )


def _fsdp_fp16_unscaling_reads_decoupled_grad() -> None:
    """FP16 + Megatron-FSDP v1 + precision-aware + MXFP8: unscaling reads what FusedAdam reads."""
    with te_standin.te_stand_in(te_modules=True):
        config = OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            fp16=True,
            use_distributed_optimizer=True,
            use_precision_aware_optimizer=True,
            fp8_recipe="mxfp8",
        )
    chunk = FsdpV1Chunk(fsdp_ddp_config())
    with te_standin.te_stand_in(te_modules=False):
        optimizer = get_megatron_optimizer(config, [chunk], use_gloo_process_groups=False)
    if not getattr(optimizer.optimizer, "use_decoupled_grad", False):
        return  # this baseline's FusedAdam reads param.grad here: nothing to disagree with
    for param, grad in chunk.make_grads().items():
        param.decoupled_grad = grad  # where FusedAdam reads, and Megatron-FSDP installs
    main_grads = optimizer._collect_main_grad_data_for_unscaling()
    assert len(main_grads) == len(list(chunk.parameters())), main_grads


def _mfsdp_v2_readers_follow_fused_adam() -> None:
    """Megatron-FSDP v2 builds FusedAdam to read param.grad: the grad norm reads it too."""
    try:
        from megatron.core.optimizer.fully_sharded_optimizer import FullyShardedOptimizer
    except ImportError:
        return  # no Megatron-FSDP v2 optimizer in this baseline
    with te_standin.te_stand_in(te_modules=True):
        config = OptimizerConfig(
            optimizer="adam", lr=1e-2, use_precision_aware_optimizer=True, clip_grad=0.5
        )

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
    """``torch.distributed.all_reduce`` calls recorded, not run: a rank issuing more of them
    than another would hang the real ones; the counts are compared afterwards."""
    calls: list = []
    original = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: calls.append(kwargs.get("group"))
    try:
        yield calls
    finally:
        dist.all_reduce = original


def _count_zeros_one_reduction_whatever_each_rank_owns() -> None:
    """Collective contract: count_zeros of a chain (ChainedOptimizer, LayerWise) makes one
    reduction on every rank, whatever its optimizers own there, each read where it reads.

    Two pipeline stages, one grad-stats group: the first chained optimizer (torch Adam, reads
    param.grad) owns parameters on stage 0 only, a stub on stage 1 (as MCore builds for a
    module a stage does not hold); the second wraps an optimizer that says
    `use_decoupled_grad` (as FusedAdam does). Counting once per attribute among the owning
    optimizers made [2, 1] reductions; reading one attribute for the chain missed zeros.
    """
    config = OptimizerConfig(optimizer="adam", lr=1e-2)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    grad_params, _ = _params_with_grads("grad")  # one zero each
    reads_grad = FP32Optimizer(
        torch.optim.Adam(grad_params, lr=1e-2) if stage == 0 else None, config, None
    )
    decoupled_params, _ = _params_with_grads("decoupled_grad")
    adam = torch.optim.Adam(decoupled_params, lr=1e-2)
    adam.use_decoupled_grad = True
    reads_decoupled = FP32Optimizer(adam, config, None)
    children = [reads_grad, reads_decoupled]
    world_size = dist.get_world_size()
    expected = len(grad_params) + world_size * len(decoupled_params)
    chains = {"ChainedOptimizer": ChainedOptimizer(children)}
    try:
        from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    except ImportError:
        pass  # no layer-wise optimizer before 0.16
    else:
        # Its real count_zeros, on what it reads of itself (building one needs a model).
        fields = dict(chained_optimizers=children, config=config, tp_group=None)
        layer_wise = SimpleNamespace(**fields, expert_tp_group=None)
        chains["LayerWiseDistributedOptimizer"] = SimpleNamespace(
            count_zeros=lambda: LayerWiseDistributedOptimizer.count_zeros(layer_wise)
        )
    for name, chain in chains.items():
        with _recorded_all_reduces() as calls:
            chain.count_zeros()
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, len(calls))
        assert per_rank == [1] * world_size, f"{name}: all_reduce calls per rank {per_rank}"
        num_zeros = float(chain.count_zeros())
        assert num_zeros == expected, f"{name}: {num_zeros} zeros, expected {expected}"


def _init_two_stages() -> None:
    """``init`` for a world of 2: two pipeline stages, one model-parallel (grad-stats) group."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    torch.manual_seed(1234)


_CASES = {
    "readers_follow_the_optimizer": _readers_follow_the_optimizer,
    "duck_typed_children": _duck_typed_children,
    "mimo_clips_where_its_optimizer_reads": _mimo_clips_where_its_optimizer_reads,
    "fsdp_fp16_unscaling_reads_decoupled_grad": _fsdp_fp16_unscaling_reads_decoupled_grad,
    "mfsdp_v2_readers_follow_fused_adam": _mfsdp_v2_readers_follow_fused_adam,
}


_TWO_RANK_CASES = {
    "count_zeros_one_reduction_whatever_each_rank_owns": (
        _count_zeros_one_reduction_whatever_each_rank_owns
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
