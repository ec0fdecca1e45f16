"""Proof of fp16-unscale-decoupled-grad: FP16 unscaling reads where the optimizer reads.

From 0.18, get_megatron_optimizer makes TE's FusedAdam read `param.decoupled_grad` for every
precision-aware optimizer under Megatron-FSDP v1, where the gradient buffer then installs the
gradients. DistributedOptimizer's FP16 unscaling decided from
`use_precision_aware_optimizer_no_fp8_or_ds_fp8` instead: with MXFP8 it read `param.grad`,
which Megatron-FSDP leaves None (AttributeError in the step).

Real MCore: OptimizerConfig, get_megatron_optimizer, DistributedOptimizer with its
DynamicGradScaler, in a forked gloo world of 1. Stand-ins, outside the code under test: TE's
FusedAdam (tests/multigpu/te_standin.py), the Megatron-FSDP v1 chunk of _support (its own
buffers need CUDA), the CUDA shim.
"""

from __future__ import annotations

from _support import (
    FsdpV1Chunk,
    check,
    fsdp_ddp_config,
    init_model_parallel,
    load_te_standin,
    precision_aware_config,
    run_world,
)
from megatron.core.optimizer import get_megatron_optimizer

te_standin = load_te_standin()


def _fsdp_fp16_unscaling_reads_decoupled_grad() -> None:
    """FP16 + Megatron-FSDP v1 + precision-aware + MXFP8: unscaling reads what FusedAdam reads."""
    config = precision_aware_config(fp16=True, fp8_recipe="mxfp8")
    chunk = FsdpV1Chunk(fsdp_ddp_config())
    with te_standin.te_stand_in(te_modules=False):
        optimizer = get_megatron_optimizer(config, [chunk], use_gloo_process_groups=False)
    assert optimizer.optimizer.use_decoupled_grad, "FusedAdam reads param.grad here"
    for param, grad in chunk.make_grads().items():
        param.decoupled_grad = grad  # where FusedAdam reads, and Megatron-FSDP installs
    main_grads = optimizer._collect_main_grad_data_for_unscaling()
    assert len(main_grads) == len(list(chunk.parameters())), main_grads


_CASES = {"fsdp_fp16_unscaling_reads_decoupled_grad": _fsdp_fp16_unscaling_reads_decoupled_grad}


def test_fp16_unscaling_reads_decoupled_grad(tmp_path):
    results = run_world(_CASES, world_size=1, out=tmp_path, init=init_model_parallel)
    check(results, "fsdp_fp16_unscaling_reads_decoupled_grad")
