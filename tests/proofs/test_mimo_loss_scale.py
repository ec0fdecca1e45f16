"""CPU proof of patch mimo-loss-scale (fix 1): MIMO loss scalers agree across module grids.

Non-colocated MIMO gives every module its own HyperCommGrid and inner optimizer, each with its
own grad scaler. An overflow seen in one grid must move every scaler in the world the same
way (the step is skipped world-wide), otherwise the LLM scales the loss by one value while the
encoder unscales the gradients it receives by another. Each module optimizer's own
`prepare_grads()` must still run once per step, and a checkpoint written with diverged scalers
must be reconciled across the world. Loading makes no collective (megatron/training skips
`load_state_dict` on stub optimizers, so a load-time collective hangs the world): the next
`prepare_grads()` reconciles, inside the one world all-reduce it makes on every path (the
found_inf reduction `step()` made before, moved). The scalers' updates are deferred while the
module optimizers run and applied once afterwards: no state copies, no host sync added.

Real HyperCommGrid process groups, inner optimizers from MCore's optimizer builder
(Float16OptimizerWithFloat16Params with a DynamicGradScaler or ConstantGradScaler),
ChainedOptimizer and MimoOptimizer, in gloo worlds of 2 and 3 ranks forked from the test
process, under the disclosed `CudaOnCpu` shim (placement only).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from _support import (
    CaptureLogs,
    CountHostSyncs,
    check,
    count_world_collectives,
    replaced_prepare_grads,
    run_world,
)
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.models.mimo.optimizer import MimoOptimizer, ModuleOptimizerInfo
from megatron.core.optimizer import _get_megatron_optimizer_based_on_param_groups
from megatron.core.optimizer.optimizer import (
    ChainedOptimizer,
    MixedPrecisionOptimizer,
    param_group_identifier_keys,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.process_groups_config import ProcessGroupCollection

ENCODER, AUDIO, LLM = "images", "audio", "language"
WARNING = "grad scaler states disagree"


def world_collectives_per_step() -> dict[str, int]:
    """World-group collectives of one MimoOptimizer.step() as upstream issues them.

    Found-inf consensus and the global grad norm, plus the update-success consensus (#5331,
    from core_v0.19.0); only the first on overflow.
    """
    clean = 3 if "ReduceOp.MIN" in inspect.getsource(MimoOptimizer.step) else 2
    return {
        "bf16": clean,
        "fp16_constant": clean,
        "fp16_dynamic": clean,
        "fp16_dynamic_overflow": 1,
    }


def _grid(rank_offset: int) -> HyperCommGrid:
    grid = HyperCommGrid(
        [1, 1, 1, 1, 1], ["tp", "cp", "ep", "pp", "dp"], rank_offset=rank_offset, backend="gloo"
    )
    for dims in ("tp", "pp", "dp", ["tp", "pp"]):
        grid.create_pg(dims)
    return grid


def _config(precision: str = "fp16_dynamic", **overrides) -> OptimizerConfig:
    kwargs = dict(
        optimizer="sgd",
        lr=0.1,
        clip_grad=1.0,
        initial_loss_scale=8.0,
        min_loss_scale=1.0,
        loss_scale_window=2,
        hysteresis=1,
    )
    if precision == "bf16":
        kwargs.update(bf16=True)
    elif precision == "fp16_constant":
        kwargs.update(fp16=True, loss_scale=8.0)
    else:
        kwargs.update(fp16=True)
    kwargs.update(overrides)
    return OptimizerConfig(**kwargs)


def _inner(config: OptimizerConfig, grid: HyperCommGrid):
    """One module chunk and its optimizer, built like get_megatron_optimizer builds them."""
    pg = ProcessGroupCollection(
        tp=grid.get_pg("tp"),
        pp=grid.get_pg("pp"),
        dp=grid.get_pg("dp"),
        mp=grid.get_pg(["tp", "pp"]),
    )
    dtype = torch.bfloat16 if config.bf16 else torch.float16
    module = torch.nn.Linear(4, 4, bias=False).to(dtype=dtype)
    optimizer = _get_megatron_optimizer_based_on_param_groups(
        config=config,
        model_chunks=[module],
        # With the keys load_state_dict() matches param groups by (required before core_v0.19).
        param_groups=[
            {"params": list(module.parameters()), **dict.fromkeys(param_group_identifier_keys)}
        ],
        model_parallel_group=pg.mp,
        pg_collection=pg,
    )
    optimizer.model_param = module.weight
    return optimizer, pg


class Mimo:
    """A MimoOptimizer over `grids` (module -> grid) and this rank's leaf optimizers."""

    def __init__(self, config, grids, share_scalers=False, wrap=None):
        infos, self.leaves, shared = {}, {}, None
        for name, grid in grids.items():
            optimizer, pg = None, None
            active = grid.is_current_rank_in_grid()
            if active:
                parts = []
                for _ in range(2 if share_scalers and name == ENCODER else 1):
                    part, pg = _inner(config, grid)
                    if share_scalers:
                        shared = shared or part.grad_scaler
                        part.grad_scaler = shared
                    self.leaves.setdefault(name, []).append(part)
                    parts.append(part)
                optimizer = parts[0] if len(parts) == 1 else ChainedOptimizer(parts)
                if wrap is not None:
                    optimizer = wrap(name, optimizer)
            infos[name] = ModuleOptimizerInfo(
                optimizer=optimizer, grid=grid, pg_collection=pg, is_active=active
            )
        self.mimo = MimoOptimizer(infos, config)

    def set_grads(self, overflow=None, value=None):
        """Grads of 1.0 scaled by the loss scale (or `value`); inf in module `overflow`."""
        for name, parts in self.leaves.items():
            for part in parts:
                fill = value if value is not None else float(part.get_loss_scale().item())
                param = part.model_param
                param.grad = torch.full_like(param, float("inf") if name == overflow else fill)

    def states(self):
        """{module: [(scale, growth_tracker, hysteresis_tracker) per leaf]} of this rank."""
        out = {}
        for name, parts in sorted(self.leaves.items()):
            out[name] = [_state(p.grad_scaler) for p in parts if p.grad_scaler is not None]
        return out

    def world_states(self):
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.states())
        merged = {}
        for states in gathered:
            for name, value in states.items():
                merged.setdefault(name, []).extend(value)
        return merged

    def main_grads(self):
        return [
            p.fp32_from_float16_groups[0][0].grad.flatten().tolist()
            for parts in self.leaves.values()
            for p in parts
        ]


def _state(scaler):
    state = scaler.state_dict()
    if not state:
        return None
    return (float(state["scale"].item()), state["growth_tracker"], state["hysteresis_tracker"])


def _grids(world_size: int, audio: bool = False):
    grids = {ENCODER: _grid(0), LLM: _grid(1 % world_size)}
    if audio:
        grids[AUDIO] = _grid(0)
    return grids


def _all_equal(world, expected):
    states = world.world_states()
    flat = [s for values in states.values() for s in values]
    assert flat and flat == [expected] * len(flat), states


def _exact_prepare(world):
    """A clean prepare_grads() after the LLM scaled the loss: every module unscales exactly.

    The loss is scaled on the LLM's ranks by its loss scale; the gradients every upstream
    module receives carry that scale. Collective: call it on every rank, assert afterwards
    (a rank-local assertion before a collective would leave the other ranks waiting).
    """
    world.set_grads(value=world.world_states()[LLM][0][0])
    found_inf = world.mimo.prepare_grads()
    return found_inf, world.main_grads()


def _assert_exact(prepared):
    found_inf, main_grads = prepared
    assert found_inf is False
    for grads in main_grads:
        assert grads == [1.0] * 16, "grads unscaled by another loss scale"


# --- the bug: one grid's overflow ----------------------------------------------------------


def case_overflow_in_one_grid_backs_off_every_scaler():
    world = Mimo(_config(), _grids(dist.get_world_size()))
    world.set_grads(overflow=ENCODER)
    assert world.mimo.step()[0] is False
    _all_equal(world, (4.0, 0, 0))
    _assert_exact(_exact_prepare(world))


def case_finite_steps_keep_scalers_identical_and_grow():
    world = Mimo(_config(), _grids(dist.get_world_size()))
    world.set_grads(overflow=ENCODER)
    assert world.mimo.step()[0] is False
    # loss_scale_window 2: one clean step counts, the second doubles the scale.
    for expected in ((4.0, 1, 0), (8.0, 0, 1), (8.0, 1, 1)):
        world.set_grads(value=0.5)
        success, grad_norm, _ = world.mimo.step()
        assert success is True
        _all_equal(world, expected)
        norms = [None] * dist.get_world_size()
        dist.all_gather_object(norms, grad_norm)
        assert len(set(norms)) == 1, norms


def case_prepare_grads_returns_world_flag():
    world = Mimo(_config(), _grids(dist.get_world_size()))
    world.set_grads(overflow=ENCODER)
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(world.mimo.prepare_grads()))
    assert flags == [True] * dist.get_world_size(), flags
    _all_equal(world, (4.0, 0, 0))


def case_shared_scaler_updated_once():
    if dist.get_world_size() != 2:
        return
    # hysteresis 2, window 2. A ChainedOptimizer's two chunks and two modules of rank 0 share
    # one scaler: one update per step (a second would double or halve the scale).
    world = Mimo(_config(hysteresis=2), _grids(2, audio=True), share_scalers=True)
    world.set_grads(value=0.5)
    world.mimo.step()
    _all_equal(world, (8.0, 1, 2))
    world.set_grads(overflow=ENCODER)
    world.mimo.step()
    _all_equal(world, (8.0, 0, 1))


def case_world_collectives_per_step_match_upstream():
    counts, expected = {}, world_collectives_per_step()
    for path in expected:
        world = Mimo(_config(path.replace("_overflow", "")), _grids(dist.get_world_size()))
        world.set_grads(overflow=ENCODER if path.endswith("_overflow") else None, value=0.5)
        with count_world_collectives() as calls:
            world.mimo.step()
        counts[path] = len(calls)
    assert counts == expected, counts


def case_one_world_collective_and_no_added_host_sync_per_prepare_grads():
    # On every path and every rank (the stub of a 3-rank world included), prepare_grads()
    # makes exactly one world collective: the all-reduce that carries found_inf (and the
    # bounds of the scaler states), overflow or not, whatever this rank holds. Host syncs:
    # each FP16 module optimizer reads its found_inf once, and the world reduction makes the
    # one host-to-device copy and the one read that step()'s found_inf reduction made upstream.
    for path in ("fp16_dynamic", "fp16_constant", "bf16"):
        for overflow in (None, ENCODER):
            world = Mimo(_config(path), _grids(dist.get_world_size()))
            world.set_grads(overflow=overflow, value=0.5)
            with count_world_collectives() as calls, CountHostSyncs() as syncs:
                world.mimo.prepare_grads()
            checks = 0 if path == "bf16" else sum(map(len, world.leaves.values()))
            assert calls == ["all_reduce"], (path, overflow, calls)
            expected = sorted(["item"] * checks + ["h2d", "tolist"])
            assert sorted(syncs.calls) == expected, (path, overflow, syncs.calls)


def case_colocated_modules_share_the_decision():
    # Both module grids on rank 0, each with its own optimizer and scaler; the other ranks
    # hold no module and still join the world reduction.
    world = Mimo(_config(), {ENCODER: _grid(0), LLM: _grid(0)})
    world.set_grads(overflow=ENCODER)
    found_inf = world.mimo.prepare_grads()
    _all_equal(world, (4.0, 0, 0))
    assert found_inf is True


# --- each module optimizer's own prepare_grads() runs once per step -------------------------


def case_instance_hooks_run_once():
    calls = []

    def wrap(name, optimizer):
        original = optimizer.prepare_grads

        def hook():
            calls.append(name)
            return original()

        optimizer.prepare_grads = hook
        return optimizer

    world = Mimo(_config(), _grids(dist.get_world_size()), wrap=wrap)
    world.set_grads(overflow=ENCODER)
    world.mimo.step()
    prepared = _exact_prepare(world)
    _all_equal(world, (4.0, 1, 0))
    assert calls == sorted(world.leaves) * 2, calls
    _assert_exact(prepared)


def case_class_level_replacement_runs_once():
    with replaced_prepare_grads(MixedPrecisionOptimizer) as calls:
        world = Mimo(_config(), _grids(dist.get_world_size()))
        world.set_grads(overflow=ENCODER)
        world.mimo.step()
        _all_equal(world, (4.0, 0, 0))
        assert calls == [p for parts in world.leaves.values() for p in parts], calls


def case_copy_pasted_override_updating_own_scaler():
    # An out-of-tree override with the upstream body, which updates its own scaler.
    def wrap(name, optimizer):
        def prepare_grads():
            optimizer._copy_model_grads_to_main_grads()
            found_inf = optimizer._unscale_main_grads_and_check_for_nan()
            optimizer.grad_scaler.update(found_inf)
            return found_inf

        optimizer.prepare_grads = prepare_grads
        return optimizer

    world = Mimo(_config(), _grids(dist.get_world_size()), wrap=wrap)
    world.set_grads(overflow=ENCODER)
    assert world.mimo.step()[0] is False
    _all_equal(world, (4.0, 0, 0))
    _assert_exact(_exact_prepare(world))


def case_direct_module_call_unchanged():
    # Compatibility: a module optimizer's prepare_grads() called directly keeps its behaviour.
    world = Mimo(_config(), _grids(dist.get_world_size()))
    world.set_grads(overflow=ENCODER)
    for parts in world.leaves.values():
        for part in parts:
            part.prepare_grads()
    states = world.world_states()
    assert states == {ENCODER: [(4.0, 0, 0)], LLM: [(8.0, 1, 1)]}, states


# --- resume from a checkpoint written with diverged scalers ---------------------------------


DIVERGED = {ENCODER: (4.0, 1, 0), LLM: (8.0, 2, 1)}


def _load_diverged(world):
    """Load a diverged checkpoint as megatron/training does: not on stub optimizers.

    Returns the WARNING messages of the load. Collective-free by contract: a rank that waits
    in a load-time collective would hang, since stub ranks never call load_state_dict().
    """
    state_dict = world.mimo.state_dict()
    for name, (scale, growth, hysteresis) in DIVERGED.items():
        if state_dict.get(name) is not None:
            state_dict[name]["grad_scaler"] = {
                "scale": torch.tensor([scale]),
                "growth_tracker": growth,
                "hysteresis_tracker": hysteresis,
            }
    with CaptureLogs() as logs:
        if not world.mimo.is_stub_optimizer:  # megatron/training/checkpointing.py's guard
            world.mimo.load_state_dict(state_dict)
    return logs.messages(WARNING)


def _assert_reconciled_by_next_step(world):
    """The first prepare_grads() after loading diverged scalers: every scaler in the world
    takes the smallest scale with reset trackers, the step is skipped (its gradients were
    unscaled by different loss scales), rank 0 logs one warning; the next one is exact.

    Collectives first, on every rank; rank-local assertions last (see _exact_prepare)."""
    world.set_grads(value=world.world_states()[LLM][0][0])
    with CaptureLogs() as logs:
        found_inf = world.mimo.prepare_grads()
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(found_inf))
    assert flags == [True] * dist.get_world_size(), flags
    _all_equal(world, (4.0, 0, 1))
    prepared = _exact_prepare(world)
    _all_equal(world, (4.0, 1, 1))
    _assert_exact(prepared)
    warnings = logs.messages(WARNING)
    if dist.get_rank() == 0:
        assert len(warnings) == 1, warnings
        assert "scales in [4, 8]" in warnings[0], warnings
    else:
        assert warnings == [], warnings


def case_resume_from_diverged_checkpoint():
    world = Mimo(_config(), _grids(dist.get_world_size()))
    with count_world_collectives() as calls:
        warnings = _load_diverged(world)
    assert calls == [] and warnings == [], (calls, warnings)
    _assert_reconciled_by_next_step(world)


def case_resume_colocated_from_diverged_checkpoint():
    # Both modules on rank 0 (diverged there, locally); the other ranks hold none.
    world = Mimo(_config(), {ENCODER: _grid(0), LLM: _grid(0)})
    _load_diverged(world)
    _assert_reconciled_by_next_step(world)


def case_identical_states_load_untouched():
    world = Mimo(_config(), _grids(dist.get_world_size()))
    world.set_grads(value=0.5)
    world.mimo.step()
    with CaptureLogs() as logs:
        _load_state(world)
        prepared = _exact_prepare(world)
    # loss_scale_window 2: the second clean step doubles the scale.
    _all_equal(world, (16.0, 0, 1))
    _assert_exact(prepared)
    assert logs.messages(WARNING) == []


def _load_state(world):
    if not world.mimo.is_stub_optimizer:
        world.mimo.load_state_dict(world.mimo.state_dict())


def case_load_adds_no_collective():
    counts = {}
    for precision in ("fp16_dynamic", "fp16_constant", "bf16"):
        world = Mimo(_config(precision), _grids(dist.get_world_size()))
        with count_world_collectives() as calls:
            world.mimo.load_state_dict(world.mimo.state_dict())
        counts[precision] = calls
    assert counts == {"fp16_dynamic": [], "fp16_constant": [], "bf16": []}, counts


CASES = {name[len("case_") :]: fn for name, fn in globals().items() if name.startswith("case_")}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Encoder grid on rank 0, LLM grid on rank 1."""
    return run_world(CASES, world_size=2, out=tmp_path_factory.mktemp("mimo2"), timeout=120)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """Encoder grid on rank 0, LLM grid on rank 1, rank 2 holds no module (stub)."""
    return run_world(CASES, world_size=3, out=tmp_path_factory.mktemp("mimo3"), timeout=120)


def stub_rank_load():
    """Encoder on rank 0, LLM on rank 1, nothing on rank 2; the load skipped on the stub."""
    world = Mimo(_config(), _grids(3))
    assert world.mimo.is_stub_optimizer is (dist.get_rank() == 2)
    _load_diverged(world)
    _assert_reconciled_by_next_step(world)


@pytest.fixture(scope="module")
def stub_load(tmp_path_factory):
    """A world of its own, with a short timeout: a load-time collective hangs it."""
    cases = {"stub_rank_load": stub_rank_load}
    return run_world(cases, world_size=3, out=tmp_path_factory.mktemp("stub"), timeout=30)


def test_load_skipped_on_stub_rank_returns_and_reconciles(stub_load):
    check(stub_load, "stub_rank_load")


@pytest.mark.parametrize("name", list(CASES))
def test_mimo_loss_scale(two_ranks, name):
    check(two_ranks, name)


@pytest.mark.parametrize("name", list(CASES))
def test_mimo_loss_scale_with_stub_rank(three_ranks, name):
    check(three_ranks, name)
