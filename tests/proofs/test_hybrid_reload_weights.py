"""Proof of hybrid-reload-weights (upstream's open PR #5071): with ``optimizer_cpu_offload``
(HybridDeviceOptimizer inside the DistributedOptimizer), a weights-only load survives the next
optimizer step.

A finetune load (``--finetune`` / ``--no-load-optim``) writes the checkpoint's weights into the
model params and calls ``optimizer.reload_model_params()``. Without the precision-aware optimizer
the HybridDeviceOptimizer steps on the DistributedOptimizer's fp32 shard masters, which that call
left at their pre-load values (and on detached CPU copies of offloaded params, which nothing
re-seeded): the first step wrote them back over the loaded weights, and training went on from
the random initialization. The fix refreshes the shard masters from the model params and
re-seeds every detached copy.

Real MCore: DistributedDataParallel and get_megatron_optimizer (adam, bf16,
``optimizer_cpu_offload``) in a forked gloo world of one rank; one step on seeded grads, the
"load" (every param set to new values, ``reload_model_params()``), then one step with zero
grads and lr 0: the weights must still be the loaded ones. Disclosed stand-ins: ``CudaOnCpu``
and ``CudaStreamsOnCpu`` (CUDA placement, streams and events on the CPU) and ``HostCopiesOnCpu``
(_support.py): every tensor reports ``is_cuda`` but the HybridDeviceOptimizer's pinned host
copies, so it offloads the shard masters to host copies that its CPU sub-optimizers step and
its hooks copy back, as on a GPU (both halves of the bug: the stale shard masters and the stale
host copies). The GPU tier is bench/hybrid_reload_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from _support import CudaStreamsOnCpu, HostCopiesOnCpu, check, init_model_parallel, run_world


def case_weights_only_load_survives_step() -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    gen = torch.Generator().manual_seed(5071)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)).bfloat16()
    ddp = DistributedDataParallel(
        TransformerConfig(num_attention_heads=1, num_layers=1),
        DistributedDataParallelConfig(use_distributed_optimizer=True),
        model,
    )
    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        bf16=True,
        clip_grad=0.0,
        use_distributed_optimizer=True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=1.0,
    )
    with CudaStreamsOnCpu(), HostCopiesOnCpu():
        optimizer = get_megatron_optimizer(config, [ddp])
        hybrid = getattr(optimizer, "chained_optimizers", [optimizer])[0].optimizer
        params = list(ddp.module.parameters())
        for p in params:
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
        optimizer.step()
        with torch.no_grad():  # the weights-only load
            for p in params:
                p.copy_(torch.randn(p.shape, generator=gen))
        loaded = [p.detach().clone() for p in params]
        optimizer.reload_model_params()
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        for p in params:
            p.main_grad.zero_()
        optimizer.step()
    assert hybrid.cpu_optimizers and hybrid.gpu_optimizer is None, "not offloaded to the host"
    deviation = max(
        float((p.float() - w.float()).abs().max()) for p, w in zip(params, loaded, strict=True)
    )
    assert deviation == 0.0, (
        f"the loaded weights moved by up to {deviation} in a step with lr 0: the optimizer "
        "wrote its pre-load copies back over them"
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict[str, str]]:
    cases = {"weights_only_load_survives_step": case_weights_only_load_survives_step}
    return run_world(cases, 1, tmp_path_factory.mktemp("w1"), init=init_model_parallel)


def test_hybrid_reload_weights(world) -> None:
    check(world, "weights_only_load_survives_step")
