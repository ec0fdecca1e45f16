"""Proof of patch param-group-lr-bounds (upstream #4705): a resume gives every param group its
own saved group back, also where groups differ only in their LR bounds (``--decoupled-lr``).

Loading matched saved param groups to the optimizer's by ``(wd_mult, lr_mult,
is_expert_parallel, is_decoupled_lr)``. From 0.16 the decoupled LR is a ``max_lr`` override and
``is_decoupled_lr`` stays False, so the embedding/output groups and the trunk's share that key:
the saved groups collapse onto one. The DistributedOptimizer then gives the trunk the decoupled
groups' bounds (50x its LR here); the optimizer without it (BF16) puts half the params in no
group at all, with other params' moments.

Real objects: DistributedDataParallel, get_megatron_optimizer (torch Adam) with
``decoupled_lr``, the DistributedOptimizer and the BF16 optimizer without it, one step, a
dist_checkpointing save of the optimizer's sharded_state_dict and a load into a fresh one, in a
forked gloo world of one rank. After the load every param must sit in exactly one group, with
the runtime's LR bounds and weight-decay multiplier, and hold its own saved moments.
Disclosed stand-ins: ``CudaOnCpu`` (CUDA placement and type names on the CPU) and a no-op
``torch.cuda.synchronize`` for the checkpoint writer.
"""

from __future__ import annotations

import megatron.core.dist_checkpointing  # noqa: F401 - imported once, before the ranks fork
import megatron.core.distributed  # noqa: F401
import megatron.core.optimizer  # noqa: F401
import pytest
import torch
from _support import (
    CheckpointDirs,
    CudaSyncOnCpu,
    build_distopt,
    check,
    distopt_step,
    init_data_parallel,
    own_state,
    run_world,
    writer_queue_in_process,
)

CKPT = CheckpointDirs("lr-bounds-ckpt-")  # shared by the forked ranks
LR, DECOUPLED_LR = 1e-4, 5e-3


class EmbeddingTrunkOutput(torch.nn.Module):
    """Eight params in four groups: the embedding's and output layer's (decoupled LR) and the
    trunk's, each split into weights (weight decay) and biases (none)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(4705)
        self.embedding = torch.nn.Linear(16, 16)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        self.output_layer = torch.nn.Linear(16, 16)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        for p in [*self.embedding.parameters(), *self.output_layer.parameters()]:
            p.is_embedding_or_output_parameter = True  # as LanguageModule marks them
        self.to(torch.bfloat16)


def _build(distributed: bool):
    ddp = {"use_distributed_optimizer": distributed}
    decoupled = dict(decoupled_lr=DECOUPLED_LR, decoupled_min_lr=DECOUPLED_LR / 10)
    (chunk,), optimizer, opts = build_distopt(
        [EmbeddingTrunkOutput()], ddp, lr=LR, min_lr=LR / 10, **decoupled
    )
    return chunk, optimizer, opts


def _main_params(opt) -> dict:
    """model param -> the param its inner optimizer steps (its main copy)."""
    if hasattr(opt, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
        return {p: state["param"] for p, state in own_state(opt).items()}
    return {
        param: main
        for params, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True)
        for param, main in zip(params, mains, strict=True)
    }


def _per_param(chunk, opt) -> dict[str, dict]:
    """param name -> the groups that hold its main copy (bounds, weight-decay multiplier) and
    its moments."""
    found = {}
    for name, param in chunk.module.named_parameters():
        main = _main_params(opt)[param]
        groups = [g for g in opt.optimizer.param_groups if any(p is main for p in g["params"])]
        state = opt.optimizer.state.get(main, {})
        found[name] = {
            "groups": [(g["max_lr"], g["min_lr"], g["wd_mult"]) for g in groups],
            "moments": {k: v.clone() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")},
        }
    return found


def _round_trip(distributed: bool) -> None:
    from megatron.core import dist_checkpointing

    chunk, optimizer, (opt,) = _build(distributed)
    distopt_step([chunk], optimizer, 0)
    saved = _per_param(chunk, opt)
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"} if distributed else None
    ckpt_dir = CKPT.new("distopt" if distributed else "bf16")
    ckpt_dir.mkdir(parents=True)
    writer_queue_in_process()
    with CudaSyncOnCpu():
        state = optimizer.sharded_state_dict(chunk.sharded_state_dict(), metadata=metadata)
        dist_checkpointing.save({"optimizer": state}, str(ckpt_dir))

        chunk, optimizer, (opt,) = _build(distributed)
        distopt_step([chunk], optimizer, 1)  # state to load into
        runtime = {name: found["groups"] for name, found in _per_param(chunk, opt).items()}
        request = optimizer.sharded_state_dict(
            chunk.sharded_state_dict(), is_loading=True, metadata=metadata
        )
        loaded = dist_checkpointing.load({"optimizer": request}, str(ckpt_dir))
        optimizer.load_state_dict(loaded["optimizer"])
    resumed = _per_param(chunk, opt)

    assert len({g for groups in runtime.values() for g in groups}) == 4, runtime
    wrong_group = {n: r["groups"] for n, r in resumed.items() if r["groups"] != runtime[n]}
    assert not wrong_group, f"(max_lr, min_lr, wd_mult) of their groups: {wrong_group}"
    wrong_state = [
        f"{n}.{k}"
        for n, r in resumed.items()
        for k, v in saved[n]["moments"].items()
        if k not in r["moments"] or not torch.equal(v, r["moments"][k])
    ]
    assert not wrong_state, f"moments not their own: {wrong_state}"


def case_distributed_optimizer() -> None:
    _round_trip(distributed=True)


def case_bf16_optimizer() -> None:
    _round_trip(distributed=False)


CASES = {"distributed_optimizer": case_distributed_optimizer, "bf16_optimizer": case_bf16_optimizer}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict[str, str]]:
    results = run_world(CASES, 1, tmp_path_factory.mktemp("w1"), init=init_data_parallel)
    CKPT.remove()
    return results


@pytest.mark.parametrize("case", CASES)
def test_param_group_lr_bounds(world, case) -> None:
    check(world, case)
