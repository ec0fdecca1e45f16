"""Shared setup of the 2-GPU tests: skip without 2 GPUs under torchrun, and the NCCL world."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

TWO_GPU_RANKS = torch.cuda.device_count() >= 2 and os.environ.get("WORLD_SIZE") == "2"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not TWO_GPU_RANKS:
        skip = pytest.mark.skip(reason="needs 2 GPUs and torchrun --nproc_per_node=2")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def world() -> Iterator[int]:
    """torchrun's NCCL world, one GPU per rank; yields this rank."""
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", timeout=timedelta(seconds=300))
    yield dist.get_rank()
    if created:
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dp_world(world: int) -> Iterator[int]:
    """The world with Megatron's groups (TP = PP = 1, so DP = 2); yields this rank."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    assert parallel_state.get_data_parallel_world_size() == 2
    yield world
    parallel_state.destroy_model_parallel()
