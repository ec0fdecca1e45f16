"""`audit` on paths that are not one checkpoint: what the one line says (no checkpoint written)."""

from __future__ import annotations

import json

from test_audit import run_audit


def test_folder_of_several_runs(tmp_path, capsys):
    """A folder holding several runs' save directories lists them (exit status 2), in JSON too."""
    (tmp_path / "run-a").mkdir()
    (tmp_path / "run-a" / "latest_checkpointed_iteration.txt").write_text("20")
    (tmp_path / "run-b" / "iter_0000010").mkdir(parents=True)
    (tmp_path / "notes").mkdir()
    code, out, err = run_audit(tmp_path, capsys=capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, (out, err)
    assert "2 runs" in err and "run-a" in err and "run-b" in err and "notes" not in err, err
    code, out, _ = run_audit(tmp_path, "--json", capsys=capsys)
    assert code == 2 and "run-a" in json.loads(out)["error"], out


def test_hostile_param_groups(tmp_path, capsys):
    """Param groups no Megatron writes (a param index of 10**12, a step of 1e308, bounds that
    are no numbers) are read in bounded time and memory: a verdict or one line, never a
    traceback."""
    import argparse

    import torch

    rank = tmp_path / "iter_0000002" / "mp_rank_00"
    rank.mkdir(parents=True)
    group = {"params": [0, 10**12], "max_lr": "x", "min_lr": None, "wd_mult": 1.0, "step": 1e308}
    state = {
        "iteration": 2,
        "args": argparse.Namespace(use_distributed_optimizer=False, iteration=0),
        "opt_param_scheduler": {"max_lr": 1e-2, "min_lr": 0.0, "num_steps": 10**30},
        "optimizer": {"optimizer": {"param_groups": [group, dict(group)], "state": {}}},
    }
    torch.save(state, rank / "model_optim_rng.pt")
    code, out, err = run_audit(tmp_path / "iter_0000002", capsys=capsys)
    assert "Traceback" not in out + err, (out, err)
    assert code == 1 and "step: damaged" in out, out  # 1e308 steps after 2 iterations
