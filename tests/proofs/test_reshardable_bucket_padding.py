"""Proof of patch reshardable-bucket-padding (upstream #5077): fully_reshardable checkpoints
hold every param's own optimizer state, whatever bucket of the grad buffer it sits in.

The fully_reshardable save gathers each grad buffer's state into world tensors packed bucket
after bucket with each bucket's end padding left out, then cuts every param's state out of
them at its ``param_index_map`` range, which counts that padding. With more than one bucket
(``overlap_grad_reduce`` with a small ``bucket_size``) every param past the first bucket is
cut from the wrong offset: its saved main param and moments are a neighbour's, shifted, and
those whose range runs past the end are padded with zeros (logged as a warning only).

Real objects: DistributedDataParallel (several buckets), get_megatron_optimizer (torch Adam),
the DistributedOptimizer, dist_checkpointing save and load to files, in a forked gloo world of
one rank. The checkpoint is read back as the save wrote it (model space, per param): it must
equal each param's own main param and moments bit for bit. Disclosed stand-ins: ``CudaOnCpu``
(CUDA placement and type names on the CPU) and a no-op ``torch.cuda.synchronize`` for the
checkpoint writer.
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
    distopt_save,
    distopt_step,
    init_data_parallel,
    own_state,
    run_world,
)

CKPT = CheckpointDirs()  # shared by the forked ranks
# Linear(70, 130): param sizes are no multiple of the bucket-end divisor (128), so every
# bucket but the last ends in padding; 5000 elements a bucket gives one bucket per layer.
DDP = {"overlap_grad_reduce": True, "bucket_size": 5000}


class FourLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5077)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(70, 130) for _ in range(4))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.to(torch.bfloat16)


def _read_back(chunks, optimizer, ckpt_dir) -> list[dict]:
    """The saved state per param, in the save's order (``param_index_map`` of each buffer)."""
    from megatron.core import dist_checkpointing

    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    model_sd = chunks[0].sharded_state_dict()
    with CudaSyncOnCpu():
        request = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)
        loaded = dist_checkpointing.load({"optimizer": request}, str(ckpt_dir))
    states = loaded["optimizer"]["param_state"]
    return [states[i] for i in sorted(states)]


def case_multi_bucket_round_trip() -> None:
    chunks, optimizer, opts = build_distopt([FourLinears()], ddp=DDP)
    (opt,) = opts
    buckets = opt.buffers[0].buckets
    paddings = [b.grad_data.numel() - b.numel_unpadded for b in buckets[:-1]]
    assert len(buckets) > 1 and any(paddings), f"no padded bucket to test: {paddings}"
    distopt_step(chunks, optimizer, 0)
    ckpt_dir = CKPT.new("fully_reshardable")
    distopt_save(chunks, optimizer, opts, "fully_reshardable", ckpt_dir)

    own = own_state(opt)
    names = {p: n for n, p in chunks[0].module.named_parameters()}
    saved = _read_back(chunks, optimizer, ckpt_dir)
    damaged = {}
    for param, tensors in zip(opt.buffers[0].param_index_map, saved, strict=True):
        for key, tensor in tensors.items():
            expected = own[param]["param" if key == "fp32_param" else key]
            if not torch.equal(tensor.flatten(), expected.flatten()):
                damaged.setdefault(names[param], []).append(key)
    assert not damaged, f"saved from the wrong offsets: {damaged}"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict[str, str]]:
    cases = {"multi_bucket_round_trip": case_multi_bucket_round_trip}
    results = run_world(cases, 1, tmp_path_factory.mktemp("w1"), init=init_data_parallel)
    CKPT.remove()
    return results


def test_reshardable_bucket_padding(world) -> None:
    check(world, "multi_bucket_round_trip")
