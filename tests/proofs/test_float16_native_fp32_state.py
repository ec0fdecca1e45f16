"""Proof of patch float16-native-fp32-state (upstream #5929, its optimizer part): without the
distributed optimizer, checkpoints of ``Float16OptimizerWithFloat16Params`` keep each param's
state under that param's own key when native fp32 params sit among 16-bit ones.

Its ``sharded_state_dict`` paired the inner optimizer's state ids (every param, in group
order: fp32 main copies of 16-bit params and native fp32 params interleaved) with the 16-bit
params alone, so every state past the first native fp32 param was keyed as another param's:
the save fails on a shape mismatch (``Optimizer shape ((32,) does not match model shape``),
or, where the shapes agree, writes and loads moments onto the wrong params. It is the
non-distributed twin of the DistributedOptimizer param-index fix of this series.

Real objects: ``Float16OptimizerWithFloat16Params`` over torch Adam in a forked gloo world of
one rank. Every tensor its ``sharded_state_dict`` would save must hold the state of the param
its key names (params found by identity, not by index); from 0.15 on (before, the checkpoint
writer loses its results in forked worlds) also a dist_checkpointing save and load to files
into a fresh optimizer, whose state must equal the saved one param by param.
Disclosed stand-ins: ``CudaOnCpu`` (CUDA placement and type names on the CPU) and a no-op
``torch.cuda.synchronize`` for the checkpoint writer.
"""

from __future__ import annotations

import megatron.core.dist_checkpointing  # noqa: F401 - imported once, before the ranks fork
import megatron.core.optimizer  # noqa: F401
import pytest
import torch
from _support import (
    CheckpointDirs,
    CudaSyncOnCpu,
    check,
    init_data_parallel,
    run_world,
    writer_queue_in_process,
)

CKPT = CheckpointDirs()  # shared by the forked ranks


class Bf16Fp32Bf16(torch.nn.Module):
    """A bf16 Linear, a native fp32 param (e.g. a gate kept in fp32), a bf16 Linear."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.pre = torch.nn.Linear(8, 4, bias=False)
        self.gate = torch.nn.Parameter(torch.zeros(32))
        self.post = torch.nn.Linear(4, 8, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.pre.bfloat16()
        self.post.bfloat16()

    def in_order(self) -> list[torch.nn.Parameter]:
        return [self.pre.weight, self.gate, self.post.weight]

    def sharded_state_dict(self) -> dict:
        from megatron.core.dist_checkpointing import ShardedTensor

        return {
            key: ShardedTensor.from_rank_offsets(key, value, replica_id=0)
            for key, value in self.state_dict(keep_vars=True).items()
        }


def _build(seed: int):
    """The model and its Float16OptimizerWithFloat16Params after one step on seeded grads."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    model = Bf16Fp32Bf16(seed)
    # before 0.19, load_state_dict() matches param groups by these keys (get_megatron_optimizer
    # sets them; this hand-built group too)
    keys = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
    inner = torch.optim.Adam([{"params": model.in_order(), **keys}], lr=1e-2)
    config = OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True)
    optimizer = Float16OptimizerWithFloat16Params(inner, config, None, lambda opt, cfg: None)
    gen = torch.Generator().manual_seed(seed)
    for p in model.in_order():
        p.main_grad = torch.randn(p.shape, generator=gen)  # where DDP puts the grads
    optimizer.step()
    return model, optimizer


def _own_state(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """model param name -> its main param (16-bit params) and moments, found by identity."""
    model_of = {
        id(main): param
        for params, mains in zip(
            optimizer.float16_groups, optimizer.fp32_from_float16_groups, strict=True
        )
        for param, main in zip(params, mains, strict=True)
    }
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for group in optimizer.optimizer.param_groups:
        for p in group["params"]:
            tensors = {k: v.clone() for k, v in optimizer.optimizer.state[p].items() if k != "step"}
            if id(p) in model_of:  # a native fp32 param is the model's own (model checkpoint)
                tensors["param"] = p.detach().clone()
            state[names[id(model_of.get(id(p), p))]] = tensors
    return state


def _keyed(sharded_tensor) -> tuple[str, str]:
    """(model param name, state key) of a saved tensor's key, e.g. optimizer.state.exp_avg.gate."""
    kind, _, name = sharded_tensor.key.removeprefix("optimizer.state.").partition(".")
    return name, "param" if kind == "fp32_param" else kind


def case_state_keyed_by_its_param() -> None:
    """Every tensor the save would write holds the state of the param its key names."""
    model, optimizer = _build(1)
    own = _own_state(model, optimizer)
    state = optimizer.sharded_state_dict(model.sharded_state_dict())
    saved = [t for group in state["fp32_from_fp16_params"] for t in group]
    for per_param in state["optimizer"]["state"].values():
        saved += (
            [t for t in per_param.values() if hasattr(t, "key")]
            if isinstance(per_param, dict)
            else []
        )
    wrong = [t.key for t in saved if not torch.equal(t.data, own[_keyed(t)[0]][_keyed(t)[1]])]
    assert not wrong and len(saved) == sum(map(len, own.values())), f"keyed wrongly: {wrong}"


def case_round_trip() -> None:
    """Saved to files and loaded into a fresh optimizer, each param gets its own state back."""
    from megatron.core import dist_checkpointing, package_info

    if (package_info.MAJOR, package_info.MINOR) < (0, 15):
        return  # dist_checkpointing.save loses its results in forked worlds before 0.15
    model, optimizer = _build(1)
    saved = _own_state(model, optimizer)
    ckpt_dir = CKPT.new("float16")
    ckpt_dir.mkdir(parents=True)
    writer_queue_in_process()
    with CudaSyncOnCpu():
        state = optimizer.sharded_state_dict(model.sharded_state_dict())
        dist_checkpointing.save({"optimizer": state}, str(ckpt_dir))
        model, optimizer = _build(2)
        request = optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True)
        loaded = dist_checkpointing.load({"optimizer": request}, str(ckpt_dir))
        optimizer.load_state_dict(loaded["optimizer"])
    loaded = _own_state(model, optimizer)
    wrong = [
        f"{n}.{k}" for n in saved for k in saved[n] if not torch.equal(saved[n][k], loaded[n][k])
    ]
    assert not wrong, f"loaded onto the wrong params: {wrong}"


CASES = {"state_keyed_by_its_param": case_state_keyed_by_its_param, "round_trip": case_round_trip}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict[str, str]]:
    results = run_world(CASES, 1, tmp_path_factory.mktemp("w1"), init=init_data_parallel)
    CKPT.remove()
    return results


@pytest.mark.parametrize("case", CASES)
def test_float16_native_fp32_state(world, case) -> None:
    check(world, case)
