"""Proof of clip-grads-empty-guard: no empty tensor list reaches multi_tensor_applier.

`clip_grad_by_total_norm_fp32` collects the gradients of its parameters from `.grad` or
`.decoupled_grad` and scales them with TE's (or apex's) multi-tensor kernels, which
dereference the first tensor of each list. A rank whose parameters hold no gradient in the
attribute read (an empty FSDP shard, or gradients installed in the other attribute) handed
`[[], []]` to the kernel: a segfault with TE. `MultiTensorContract` (tests/proofs/_support.py)
holds the applier to that contract on CPU: an empty list raises instead of crashing.

Real MCore code throughout (clip_grads, get_grad_norm_fp32, a forked gloo world of 2 ranks);
the CUDA shim of _support moves MCore's `device='cuda'` scalars to the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _support import MultiTensorContract, check, run_world
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32


def _clip_without_grads() -> None:
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    for use_decoupled_grad in (False, True):
        # A float norm above max_norm takes the scale path; a tensor norm (what
        # get_grad_norm_fp32 returns with TE) always launches the scale kernel.
        for total_norm in (10.0, torch.full((1,), 10.0)):
            with MultiTensorContract() as contract:
                clip_grad_by_total_norm_fp32(
                    params, 1.0, total_norm, use_decoupled_grad=use_decoupled_grad
                )
            assert not contract.calls, contract.calls
    assert all(p.grad is None for p in params)


def _clip_with_grads_still_scales() -> None:
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    for param in params:
        param.grad = torch.full((3,), 2.0)
    total_norm = math.sqrt(4.0 * 6)
    with MultiTensorContract() as contract:
        clip_grad_by_total_norm_fp32(params, 1.0, total_norm)
    assert contract.calls, "the scale kernel did not run"
    clipped = math.sqrt(sum(float(p.grad.square().sum()) for p in params))
    assert math.isclose(clipped, 1.0, rel_tol=1e-4), clipped


def _one_rank_without_grads() -> None:
    """Rank 1 holds no gradient (an empty shard): both ranks finish with the same norm."""
    rank = dist.get_rank()
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    if rank == 0:
        for param in params:
            param.grad = torch.full((4,), 1.0)
    grads = [p.grad for p in params if p.grad is not None]
    with MultiTensorContract():
        total_norm = get_grad_norm_fp32(grads, grad_stats_parallel_group=None)
        norms = [torch.zeros(1) for _ in range(2)]
        dist.all_gather(norms, torch.tensor([float(total_norm)]))
        # No collective from here on: a rank that fails here cannot hang the other.
        clip_grad_by_total_norm_fp32(params, 0.5, total_norm)
    assert math.isclose(float(norms[0]), float(norms[1])), norms
    assert math.isclose(float(total_norm), math.sqrt(8.0), rel_tol=1e-5), total_norm
    if rank == 0:
        clipped = math.sqrt(sum(float(p.grad.square().sum()) for p in params))
        assert math.isclose(clipped, 0.5, rel_tol=1e-4), clipped


_CASES = {
    "clip_without_grads": _clip_without_grads,
    "clip_with_grads_still_scales": _clip_with_grads_still_scales,
}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run_world(_CASES, world_size=1, out=tmp_path_factory.mktemp("one_rank"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_world(
        {"one_rank_without_grads": _one_rank_without_grads},
        world_size=2,
        out=tmp_path_factory.mktemp("two_ranks"),
    )


def test_clip_without_grads_never_reaches_multi_tensor_applier(one_rank):
    check(one_rank, "clip_without_grads")


def test_clip_with_grads_still_scales(one_rank):
    """Compatibility: with gradients, clipping scales them exactly as before."""
    check(one_rank, "clip_with_grads_still_scales")


def test_rank_without_grads_finishes_with_the_same_norm(two_ranks):
    check(two_ranks, "one_rank_without_grads")
