"""tests/proofs/_support.py run_world: a rank that dies fails its world at once, with its error."""

from __future__ import annotations

import sys
import time

import pytest
from toolworld import MAIN

torch = pytest.importorskip("torch")
sys.path.insert(0, str(MAIN / "tests" / "proofs"))
import _support  # noqa: E402


def test_a_rank_dead_before_the_rendezvous_fails_the_world_promptly(tmp_path, monkeypatch):
    real = _support.dist.init_process_group

    def init_process_group(backend: str, rank: int, world_size: int) -> None:
        if rank == 1:  # dies before it joins: rank 0 waits for it in the rendezvous
            raise ImportError("No module named 'transformer_engine'")
        real(backend, rank=rank, world_size=world_size)

    monkeypatch.setattr(_support.dist, "init_process_group", init_process_group)
    start = time.monotonic()
    results = _support.run_world({"case": lambda: None}, 2, tmp_path, timeout=30)
    assert time.monotonic() - start < 15  # not the timeout
    assert "ImportError: No module named 'transformer_engine'" in results[1]["<world>"]
    # rank 0, the first that check() reports, was stopped: it names rank 1's error
    with pytest.raises(AssertionError, match=r"(?s)rank 0: .*rank 1 .*transformer_engine"):
        _support.check(results, "case")


def test_ranks_that_finish_at_different_times_are_not_dead(tmp_path) -> None:
    def case() -> None:
        time.sleep(0.5 * torch.distributed.get_rank())

    results = _support.run_world({"case": case, "after": lambda: None}, 2, tmp_path, timeout=30)
    assert results == [{"case": "ok", "after": "ok"}] * 2
