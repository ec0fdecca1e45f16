"""Load checkpoints that writers.py wrote, with the MCore tree on PYTHONPATH, as megatron/training
loads them (model weights first, then the optimizer), and say whether every param got its own
state back.

    PYTHONPATH=<megatron tree> python readers.py CHECKPOINTS OUT.json SCENARIO...

For each scenario (a one_step scenario of writers.py, written under CHECKPOINTS/<scenario>),
OUT.json maps it to "exact" (every param's main param and moments are its own, bit for bit),
"permuted: <params>" (some param holds another param's state: a silent corruption), or
"error: <the load's exception>" (the load failed loudly).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "proofs"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron.core.dist_checkpointing  # noqa: E402, F401 - imported once, before the forks
import megatron.core.distributed  # noqa: E402, F401
import megatron.core.optimizer  # noqa: E402, F401
from _support import CudaSyncOnCpu, run_world  # noqa: E402
from writers import (  # noqa: E402
    ITERATION,
    SCENARIOS,
    WORLDS,
    _step,
    dist_metadata,
    own_states,
    rank_dir,
    truth_file,
)


def _load(chunk, optimizer, ckpt: Path, fmt: str) -> None:
    """Model weights, then the optimizer state, as megatron/training's load_checkpoint does."""
    from megatron.core import dist_checkpointing

    iteration = ckpt / f"iter_{ITERATION:07d}"
    if fmt == "legacy":
        state = torch.load(rank_dir(iteration) / "model_optim_rng.pt", weights_only=False)
        chunk.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        optimizer.load_parameter_state(str(rank_dir(iteration) / "distrib_optim.pt"))
        return
    metadata = dist_metadata(fmt)
    model_sd = chunk.sharded_state_dict()
    request = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata),
    }
    loaded = dist_checkpointing.load(request, str(iteration))
    with torch.no_grad():
        for key, sharded in model_sd.items():
            sharded.data.copy_(loaded["model"][key])
    optimizer.load_state_dict(loaded["optimizer"])


def _read(name: str, ckpt: Path, out: Path) -> None:
    """Writes the outcome to `out` (one file per rank)."""
    (out / f"{name}.{dist.get_rank()}.txt").write_text(_outcome(name, ckpt))


def _outcome(name: str, ckpt: Path) -> str:
    scenario = SCENARIOS[name][1]
    chunk, optimizer = scenario.make()
    _step(chunk, optimizer, seed=1)  # state of its own, unlike the checkpoint's
    truth = torch.load(truth_file(ckpt), weights_only=False)
    try:
        with CudaSyncOnCpu():
            _load(chunk, optimizer, ckpt, scenario.fmt)
    except Exception as e:  # noqa: BLE001 - the outcome: a loud failure
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return f"error: {type(e).__name__}: {first}"
    got = own_states(chunk, optimizer)
    wrong = sorted(
        n
        for n, tensors in truth.items()
        if not all(torch.equal(got[n][k], t) for k, t in tensors.items())
    )
    return f"permuted: {', '.join(wrong)}" if wrong else "exact"


def main() -> int:
    ckpts, out, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    outcomes = {}
    for world, (size, init) in WORLDS.items():
        with tempfile.TemporaryDirectory() as tmp:
            told = Path(tmp)
            cases = {
                n: (lambda n=n, told=told: _read(n, ckpts / n, told))
                for n in names
                if SCENARIOS[n][0] == world
            }
            if not cases:
                continue
            results = run_world(cases, size, told, init=init, timeout=240)
            for name in cases:
                said = [told / f"{name}.{rank}.txt" for rank in range(size)]
                per_rank = [p.read_text() for p in said if p.exists()]
                if len(per_rank) < size:  # the world itself failed
                    per_rank.append("no outcome: " + str([r.get(name) for r in results])[-300:])
                outcomes[name] = next((o for o in per_rank if o != "exact"), "exact")
    out.write_text(json.dumps(outcomes, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
