"""Fix 3 on two GPUs: Megatron-FSDP v1 at DP=2 with a precision-aware optimizer.

Real Megatron-FSDP v1 (optim_grads_params) and get_megatron_optimizer with
use_precision_aware_optimizer and the DDP config left at its default. Transformer Engine is not
needed: `FusedAdamStandIn` stands in for TE's FusedAdam and follows its documented contract
(reads `param.decoupled_grad` iff `use_decoupled_grad`, else `param.grad`; skips params whose
gradient is None); MCore is made to see it where it would build TE's FusedAdam.

Two models, the same 2-rank world:
- `mlp` (Linear 16->64, ReLU, Linear 64->1): the 1-element bias and the one-row weight of the
  last layer leave a rank with empty shards of some params;
- `one_row` (a single Linear 16->1 without bias): the only FSDP unit pads to 2 rows, so one
  rank holds no element of the model at all.
For each: one training step with gradient clipping (clip_grad below the norm, so the scale
path runs), no crash and no empty tensor list handed to multi_tensor_applier (TE's kernels
dereference element 0 of each list), the same update decision on both ranks, weights updated,
and a grad norm equal to that of a non-FSDP reference: MCore DDP + DistributedOptimizer
(torch Adam) on the same weights and the same per-rank batches. Unpatched, the optimizer reads
`decoupled_grad` while Megatron-FSDP installs `grad`: grad norm 0, weights frozen.

Run on a host with 2 GPUs, with a patched tree (e.g. build/trees/main) on PYTHONPATH:

    PYTHONPATH=/path/to/tree torchrun --nproc_per_node=2 -m pytest \
        -o addopts= -q tests/multigpu/test_fsdp_dp2.py

Skipped with fewer than 2 GPUs or outside torchrun (conftest.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from te_standin import te_stand_in

CLIP_GRAD = 1e-3


@contextlib.contextmanager
def record_empty_kernel_calls() -> Iterator[list[str]]:
    """Record multi_tensor_applier calls of clip_grads that get an empty tensor list (where
    TE's kernels would crash); the calls themselves run unchanged."""
    from megatron.core.optimizer import clip_grads

    original = clip_grads.multi_tensor_applier
    empty: list[str] = []

    def recording(op: Any, noop_flag: Any, tensor_lists: Any, *args: Any) -> Any:
        if any(len(tensor_list) == 0 for tensor_list in tensor_lists):
            empty.append(getattr(op, "__name__", repr(op)))
        return original(op, noop_flag, tensor_lists, *args)

    clip_grads.multi_tensor_applier = recording
    try:
        yield empty
    finally:
        clip_grads.multi_tensor_applier = original


def _module(kind: str) -> torch.nn.Module:
    torch.manual_seed(1234)  # the same weights on both ranks and in both runs
    if kind == "mlp":
        module = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )
    else:
        module = torch.nn.Sequential(torch.nn.Linear(16, 1, bias=False))
    return module.cuda()


def _optimizer_config(precision_aware: bool) -> Any:
    from megatron.core.optimizer import OptimizerConfig

    with te_stand_in(te_modules=precision_aware):
        return OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            weight_decay=0.0,
            use_distributed_optimizer=True,
            use_precision_aware_optimizer=precision_aware,
            clip_grad=CLIP_GRAD,
            log_num_zeros_in_grad=True,
        )


def _batch() -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(100 + dist.get_rank())
    return torch.randn(8, 16, generator=gen, device="cuda")


def _fsdp_step(kind: str) -> dict[str, Any]:
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    model = FullyShardedDataParallel(
        config=TransformerConfig(num_attention_heads=1, num_layers=1, hidden_size=16),
        ddp_config=DistributedDataParallelConfig(
            use_megatron_fsdp=True,
            use_distributed_optimizer=True,
            data_parallel_sharding_strategy="optim_grads_params",
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        ),
        module=_module(kind),
        fsdp_unit_modules=[torch.nn.Linear],
    )
    config = _optimizer_config(precision_aware=True)
    with te_stand_in(te_modules=False):
        optimizer = get_megatron_optimizer(config, [model], use_gloo_process_groups=False)
    main_weights = list(optimizer.get_parameters())
    locals_before = [getattr(p, "_local_tensor", p).detach().clone() for p in main_weights]

    with record_empty_kernel_calls() as empty_calls:
        optimizer.zero_grad()
        model(_batch()).square().mean().backward()
        model.finish_grad_sync()
        success, grad_norm, num_zeros = optimizer.step()
    torch.cuda.synchronize()
    if hasattr(model, "stop_communication"):
        model.stop_communication()

    locals_after = [getattr(p, "_local_tensor", p) for p in main_weights]
    return {
        "success": success,
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "num_zeros": num_zeros,
        "local_elements": sum(t.numel() for t in locals_after),
        "empty_local_shards": sum(t.numel() == 0 for t in locals_after),
        "weights_changed": any(
            not torch.equal(before, after)
            for before, after in zip(locals_before, locals_after, strict=True)
        ),
        "empty_kernel_calls": empty_calls,
        "reads": "decoupled_grad" if optimizer.optimizer.use_decoupled_grad else "grad",
    }


def _reference_grad_norm(kind: str) -> float:
    """The same step with MCore DDP + DistributedOptimizer (torch Adam), no Megatron-FSDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    model = DistributedDataParallel(
        TransformerConfig(num_attention_heads=1, num_layers=1, hidden_size=16),
        DistributedDataParallelConfig(use_distributed_optimizer=True),
        _module(kind),
    )
    optimizer = get_megatron_optimizer(_optimizer_config(precision_aware=False), [model])
    model.zero_grad_buffer()
    optimizer.zero_grad()
    model(_batch()).square().mean().backward()
    model.finish_grad_sync()
    success, grad_norm, _ = optimizer.step()
    assert success and grad_norm is not None
    return float(grad_norm)


@pytest.mark.parametrize("kind", ["mlp", "one_row"])
def test_fsdp_dp2_precision_aware_step_matches_ddp(dp_world: int, kind: str) -> None:
    observed = _fsdp_step(kind)
    reference = _reference_grad_norm(kind)
    ranks: list[Any] = [None, None]
    dist.all_gather_object(ranks, observed)

    assert all(r["reads"] == "decoupled_grad" for r in ranks), ranks
    assert not any(r["empty_kernel_calls"] for r in ranks), f"empty lists (TE crash): {ranks}"
    assert [r["success"] for r in ranks] == [True, True], ranks
    norms = [r["grad_norm"] for r in ranks]
    assert norms[0] == norms[1], ranks
    assert norms[0] is not None and norms[0] > CLIP_GRAD, f"grad norm 0 or too small: {ranks}"
    assert norms[0] == pytest.approx(reference, rel=1e-5), (ranks, reference)
    # Every element of the model lives on some rank, and some rank has an empty shard (in
    # `one_row`, one rank holds nothing at all); ranks with elements updated them.
    assert any(r["empty_local_shards"] for r in ranks), ranks
    if kind == "one_row":
        assert sorted(r["local_elements"] for r in ranks) == [0, 16], ranks
    assert all(r["weights_changed"] for r in ranks if r["local_elements"]), ranks
