"""Proof of patch fsdp-preinit-step (upstream #5976): Megatron-FSDP's ``fully_shard(model,
optimizer)`` leaves the optimizer as it was given, so its first real step is the step the
optimizer would take unsharded.

To allocate optimizer state for checkpoint loading, ``fully_shard_optimizer`` ran one
``optimizer.step()`` on zero gradients at wrap time. That step was not inert: Adam's step
counter was 1 before training (the first real update then used step 2's bias corrections:
0.74x its size), and with weight decay the weights moved before any training. The fix zeroes
lr and weight decay for that step and resets the step counters.

Real objects: ``fully_shard`` of megatron_fsdp on a CPU device mesh of one gloo rank, torch
AdamW with weight decay, then one optimizer step on given gradients, compared with AdamW on an
unsharded copy. Disclosed stand-ins: ``CudaOnCpu`` (CUDA placement and type names on the CPU)
and ``CudaStreamsOnCpu`` (CUDA streams and events as in-order no-ops).
"""

from __future__ import annotations

import megatron.core.distributed.fsdp.src.megatron_fsdp  # noqa: F401 - imported before the fork
import pytest
import torch
from _support import CudaStreamsOnCpu, check, run_world

LR, WEIGHT_DECAY = 1e-2, 0.1


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5976)
        self.weight = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
        self.bias = torch.nn.Parameter(torch.randn(8, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def case_first_step_matches_unsharded() -> None:
    from megatron.core.distributed.fsdp.src.megatron_fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    reference = Linear()
    initial = [p.detach().clone() for p in reference.parameters()]
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    module = Linear()
    with CudaStreamsOnCpu():
        _, optimizer = fully_shard(
            module,
            torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY),
            device_mesh=mesh,
            dp_shard_dim="dp",
            tp_dim="tp",
            fsdp_unit_modules=[Linear],
            device=torch.device("cpu"),
        )
        params = [p for group in optimizer.param_groups for p in group["params"]]
        steps = sorted({float(s["step"]) for s in optimizer.state.values() if "step" in s})
        assert steps in ([], [0.0]), f"Adam's step count is {steps} before training"
        moved = [
            not torch.equal(_local(p.detach()), w) for p, w in zip(params, initial, strict=True)
        ]
        assert not any(moved), "fully_shard moved the weights before training"
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step(sync_grad_before_optimizer_step=False)
    unsharded = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for p in reference.parameters():
        p.grad = torch.ones_like(p)
    unsharded.step()
    for p, expected in zip(params, reference.parameters(), strict=True):
        torch.testing.assert_close(_local(p.detach()), expected.detach())


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict[str, str]]:
    cases = {"first_step_matches_unsharded": case_first_step_matches_unsharded}
    return run_world(cases, 1, tmp_path_factory.mktemp("w1"))


def test_fsdp_preinit_step(world) -> None:
    check(world, "first_step_matches_unsharded")
