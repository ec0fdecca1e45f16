"""CPU proof of patch chained-loss-scale (fix 4): one loss-scale decision per ChainedOptimizer.

With FP16 dynamic loss scaling and MoE, `get_megatron_optimizer` chains a dense and an
expert-parallel `MixedPrecisionOptimizer`, each with its own `DynamicGradScaler`. The step is
taken or skipped as a whole, so every scaler of the chain must follow that one decision:
an overflow in one chain backs off both scales, and a skipped step never counts as a clean
one. Meanwhile each chained optimizer's own `prepare_grads()` (overrides, instance hooks,
class-level replacements) must still run exactly once per step, and a checkpoint written
with diverged scalers must load reconciled (locally: loading makes no collective; rank 0 logs
the one warning). The chain defers its scalers' `update()` while the children run and updates
each once afterwards: no state copies, and no collective or host sync beyond upstream's.

Real MCore objects (Float16OptimizerWithFloat16Params, ChainedOptimizer, grad scalers) in one
world of 2 gloo ranks forked from the test process, under the disclosed `CudaOnCpu` shim
(placement only). Each case runs on both ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _support import (
    CaptureLogs,
    CountAllReduce,
    CountHostSyncs,
    check,
    count_world_collectives,
    replaced_prepare_grads,
    run_world,
)
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    MixedPrecisionOptimizer,
    param_group_identifier_keys,
)

GROWTH_INTERVAL = 3
WARNING = "grad scaler states disagree"


def _scaler(hysteresis: int = 1) -> DynamicGradScaler:
    return DynamicGradScaler(
        initial_scale=8.0,
        min_scale=1.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=GROWTH_INTERVAL,
        hysteresis=hysteresis,
    )


def _state(scaler) -> tuple[float, int, int]:
    state = scaler.state_dict()
    return (float(state["scale"].item()), state["growth_tracker"], state["hysteresis_tracker"])


def _config(bf16: bool = False) -> OptimizerConfig:
    return OptimizerConfig(optimizer="sgd", lr=0.0, fp16=not bf16, bf16=bf16, clip_grad=0.0)


def _optimizer(grad_scaler, cls=Float16OptimizerWithFloat16Params, bf16=False, group=None):
    """One 16-bit param and its optimizer, built as `get_megatron_optimizer` builds them."""
    dtype = torch.bfloat16 if bf16 else torch.float16
    param = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
    # The keys load_state_dict() matches param groups by (required before core_v0.19).
    param_group = {"params": [param], **dict.fromkeys(param_group_identifier_keys)}
    sgd = torch.optim.SGD([param_group], lr=0.0)
    optimizer = cls(sgd, _config(bf16), grad_scaler, lambda *a: None)
    optimizer.grad_stats_parallel_group = group
    optimizer.model_param = param
    return optimizer


def _leaves(optimizer):
    if isinstance(optimizer, ChainedOptimizer):
        return [leaf for child in optimizer.chained_optimizers for leaf in _leaves(child)]
    return [optimizer]


def _set_grads(chained, overflow, scale=None):
    """Grads of 1.0 scaled by the chain's loss scale; inf in the leaves marked in `overflow`."""
    scale = float(chained.get_loss_scale().item()) if scale is None else scale
    for optimizer, inf in zip(_leaves(chained), overflow, strict=False):
        param = optimizer.model_param
        param.grad = torch.full_like(param, float("inf") if inf else scale)


def _step(chained, overflow) -> bool:
    _set_grads(chained, overflow)
    return chained.step()[0]


def _main_grads(optimizer):
    return optimizer.fp32_from_float16_groups[0][0].grad.tolist()


def _assert_each_prepared_once(chained, calls, expected):
    """An expert-only overflow step, then a clean one: each child's prepare_grads (as hooked,
    recorded in `calls`) ran once per step, and both scalers backed off once, together."""
    dense, expert = chained.chained_optimizers
    assert _step(chained, [False, True]) is False
    assert calls == expected, calls
    assert _state(dense.grad_scaler) == _state(expert.grad_scaler) == (4.0, 0, 0)
    _assert_exact_next_step(chained)
    assert calls == expected * 2, calls


def _assert_exact_next_step(chained):
    """A clean step's prepare_grads(): every chained optimizer unscales the loss scale exactly."""
    _set_grads(chained, [False] * len(_leaves(chained)))
    assert chained.prepare_grads() is False
    for optimizer in _leaves(chained):
        assert _main_grads(optimizer) == [1.0] * 4, "grads unscaled by another loss scale"


# --- the bug: one chain's overflow ---------------------------------------------------------


def _overflow_in_one_chain(overflow):
    dense, expert = _optimizer(_scaler()), _optimizer(_scaler())
    chained = ChainedOptimizer([dense, expert])
    assert _step(chained, overflow) is False
    states = (_state(dense.grad_scaler), _state(expert.grad_scaler))
    assert states == ((4.0, 0, 0), (4.0, 0, 0)), states
    assert [o.get_loss_scale().item() for o in (chained, dense, expert)] == [4.0] * 3
    _assert_exact_next_step(chained)


def case_expert_only_overflow():
    _overflow_in_one_chain([False, True])


def case_dense_only_overflow():
    _overflow_in_one_chain([True, False])


def case_growth_after_overflow():
    dense, expert = _optimizer(_scaler()), _optimizer(_scaler())
    chained = ChainedOptimizer([dense, expert])
    assert _step(chained, [False, True]) is False
    history = []
    for _ in range(GROWTH_INTERVAL):
        assert _step(chained, [False, False]) is True
        history.append((_state(dense.grad_scaler), _state(expert.grad_scaler)))
    assert history == [
        ((4.0, 1, 0), (4.0, 1, 0)),
        ((4.0, 2, 0), (4.0, 2, 0)),
        ((8.0, 0, 1), (8.0, 0, 1)),
    ], history


def case_shared_scaler_updated_once():
    # hysteresis 2: one update per overflow consumes one level; a second would halve the scale.
    scaler = _scaler(hysteresis=2)
    first, second = _optimizer(scaler), _optimizer(scaler)
    chained = ChainedOptimizer([first, second])
    assert _step(chained, [True, True]) is False
    assert _state(scaler) == (8.0, 0, 1)
    # Clean steps up to the growth step: the second optimizer must unscale by the same scale
    # as the first (the scale grows only after both are prepared).
    for expected in ((8.0, 1, 1), (8.0, 2, 1), (16.0, 0, 2)):
        assert _step(chained, [False, False]) is True
        assert _state(scaler) == expected
        assert _main_grads(first) == _main_grads(second) == [1.0] * 4


def case_nested_chain():
    dense, expert = _optimizer(_scaler()), _optimizer(_scaler())
    other = _optimizer(dense.grad_scaler)
    chained = ChainedOptimizer([ChainedOptimizer([dense, other]), expert])
    _set_grads(chained, [False, False, True])
    assert chained.prepare_grads() is True
    assert _state(dense.grad_scaler) == _state(expert.grad_scaler) == (4.0, 0, 0)
    _assert_exact_next_step(chained)


def case_three_way_chain():
    optimizers = [_optimizer(_scaler()) for _ in range(3)]
    chained = ChainedOptimizer(optimizers)
    assert _step(chained, [False, True, False]) is False
    assert [_state(o.grad_scaler) for o in optimizers] == [(4.0, 0, 0)] * 3
    _assert_exact_next_step(chained)


# --- each chained optimizer's own prepare_grads() runs once per step ------------------------


def case_subclass_override_runs_once():
    calls = []

    class Overriding(Float16OptimizerWithFloat16Params):
        def prepare_grads(self):
            calls.append(self)
            return super().prepare_grads()

    dense, expert = _optimizer(_scaler(), Overriding), _optimizer(_scaler(), Overriding)
    chained = ChainedOptimizer([dense, expert])
    _assert_each_prepared_once(chained, calls, [dense, expert])


def case_instance_hook_runs_once():
    dense, expert = _optimizer(_scaler()), _optimizer(_scaler())
    calls = []
    for name, optimizer in (("dense", dense), ("expert", expert)):
        original = optimizer.prepare_grads

        def hook(name=name, original=original):
            calls.append(name)
            return original()

        optimizer.prepare_grads = hook
    chained = ChainedOptimizer([dense, expert])
    _assert_each_prepared_once(chained, calls, ["dense", "expert"])


def case_class_level_replacement_runs_once():
    # What hardware-adaptation layers do: replace MixedPrecisionOptimizer.prepare_grads.
    with replaced_prepare_grads(MixedPrecisionOptimizer) as calls:
        dense, expert = _optimizer(_scaler()), _optimizer(_scaler())
        chained = ChainedOptimizer([dense, expert])
        _assert_each_prepared_once(chained, calls, [dense, expert])


def case_copy_pasted_override_updating_own_scaler():
    # An out-of-tree override with the upstream body, which updates its own scaler.
    class CopyPasted(Float16OptimizerWithFloat16Params):
        @torch.no_grad()
        def prepare_grads(self):
            self._copy_model_grads_to_main_grads()
            found_inf_flag = self._unscale_main_grads_and_check_for_nan()
            self.grad_scaler.update(found_inf_flag)
            return found_inf_flag

    dense, expert = _optimizer(_scaler()), _optimizer(_scaler(), CopyPasted)
    chained = ChainedOptimizer([dense, expert])
    assert _step(chained, [True, False]) is False
    assert _state(dense.grad_scaler) == _state(expert.grad_scaler) == (4.0, 0, 0)
    _assert_exact_next_step(chained)
    assert _state(dense.grad_scaler) == _state(expert.grad_scaler) == (4.0, 1, 0)


def case_direct_child_call_unchanged():
    # Compatibility: a chained optimizer's prepare_grads() called directly (out of tree)
    # still updates its own scaler with its own flag, as before.
    dense, expert = _optimizer(_scaler()), _optimizer(_scaler())
    ChainedOptimizer([dense, expert])
    expert.model_param.grad = torch.full_like(expert.model_param, float("inf"))
    assert expert.prepare_grads() is True
    assert _state(expert.grad_scaler) == (4.0, 0, 0)
    assert _state(dense.grad_scaler) == (8.0, 0, 1)


def case_duck_typed_children():
    # Chained optimizers need not be MegatronOptimizers (upstream's tests chain mocks); their
    # prepare_grads() still takes part in the one decision every chained scaler follows.
    class Plain:
        def __init__(self, config, found_inf):
            self.config, self.found_inf, self.calls = config, found_inf, 0

        def prepare_grads(self):
            self.calls += 1
            return self.found_inf

    dense = _optimizer(_scaler())
    plain = Plain(dense.config, found_inf=True)
    chained = ChainedOptimizer([dense, plain])
    _set_grads(chained, [False])
    assert chained.prepare_grads() is True
    assert plain.calls == 1
    assert _state(dense.grad_scaler) == (4.0, 0, 0)
    mocks = ChainedOptimizer([Plain(dense.config, False), Plain(dense.config, False)])
    assert mocks.prepare_grads() is False


def case_nested_chain_hook_runs_once():
    # A hooked nested chain: its own prepare_grads() runs once, its scalers follow the outer
    # chain's one decision (an overflow outside it).
    inner = ChainedOptimizer([_optimizer(_scaler()), _optimizer(_scaler())])
    expert = _optimizer(_scaler())
    calls = []
    original = inner.prepare_grads
    inner.prepare_grads = lambda: calls.append("inner") or original()
    chained = ChainedOptimizer([inner, expert])
    _set_grads(chained, [False, False, True])
    assert chained.prepare_grads() is True
    assert calls == ["inner"]
    assert [_state(o.grad_scaler) for o in _leaves(chained)] == [(4.0, 0, 0)] * 3
    _assert_exact_next_step(chained)


def case_failing_child_leaves_scalers_updatable():
    # A chained optimizer that raises: the error propagates, and the scalers update again
    # afterwards (the chain defers their updates only while its children run).
    class Failing(Float16OptimizerWithFloat16Params):
        def prepare_grads(self):
            raise RuntimeError("child failed")

    dense, failing = _optimizer(_scaler()), _optimizer(_scaler(), Failing)
    with pytest.raises(RuntimeError, match="child failed"):
        ChainedOptimizer([dense, failing]).prepare_grads()
    dense.grad_scaler.update(True)
    assert _state(dense.grad_scaler) == (4.0, 0, 0)
    assert _state(failing.grad_scaler) == (8.0, 0, 1)


# --- unchanged paths ---------------------------------------------------------------------


def case_bf16_without_scaler_no_collective():
    dense, expert = _optimizer(None, bf16=True), _optimizer(None, bf16=True)
    chained = ChainedOptimizer([dense, expert])
    assert chained.get_loss_scale().item() == 1.0
    _set_grads(chained, [False, False])
    with CountAllReduce() as count:
        assert not chained.prepare_grads()
    assert count.calls == 0, "BF16 without loss scale must not add a collective"
    assert _step(chained, [False, False]) is True


def case_constant_scaler():
    dense, expert = _optimizer(ConstantGradScaler(8.0)), _optimizer(ConstantGradScaler(8.0))
    chained = ChainedOptimizer([dense, expert])
    _set_grads(chained, [False, True])
    with CountAllReduce() as count:
        assert chained.prepare_grads() is True
    assert count.calls == 2, "one inf/nan check per chained optimizer, nothing more"
    _assert_exact_next_step(chained)
    assert dense.get_loss_scale().item() == expert.get_loss_scale().item() == 8.0


def case_single_optimizer_unchanged():
    optimizer = _optimizer(_scaler())
    reference = _scaler()
    for inf in (True, False, False, False, True, False):
        scale = float(optimizer.get_loss_scale().item())
        optimizer.model_param.grad = torch.full_like(
            optimizer.model_param, float("inf") if inf else scale
        )
        assert optimizer.step()[0] is (not inf)
        reference.update(inf)
        assert _state(optimizer.grad_scaler) == _state(reference)


def case_rank_consistency():
    # Dense grad stats reduced over the world (like model-parallel ranks or distributed
    # optimizer shards), expert grad stats within each rank. Only rank 1 overflows (dense).
    rank = dist.get_rank()
    own = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r])
        if r == rank:
            own = group
    dense, expert = _optimizer(_scaler(), group=None), _optimizer(_scaler(), group=own)
    chained = ChainedOptimizer([dense, expert])
    _set_grads(chained, [rank == 1, False])
    with CountAllReduce() as count:
        found_inf = chained.prepare_grads()
    assert count.calls == 2, "one inf/nan check per chained optimizer, nothing more"
    results = [None] * dist.get_world_size()
    dist.all_gather_object(
        results, (found_inf, _state(dense.grad_scaler), _state(expert.grad_scaler))
    )
    assert results == [(True, (4.0, 0, 0), (4.0, 0, 0))] * dist.get_world_size(), results


def case_host_syncs_per_prepare_grads_match_upstream():
    # Upstream reads each chained optimizer's found_inf once (`.item()`, FP16 only); the chain
    # adds no host sync, no host-to-device copy, on any path.
    counts = {}
    for path, make in (
        ("fp16_dynamic", _scaler),
        ("fp16_constant", lambda: ConstantGradScaler(8.0)),
    ):
        for overflow in (False, True):
            chained = ChainedOptimizer([_optimizer(make()), _optimizer(make())])
            _set_grads(chained, [False, overflow])
            with CountHostSyncs() as syncs:
                chained.prepare_grads()
            counts[path, overflow] = syncs.calls
    chained = ChainedOptimizer([_optimizer(None, bf16=True), _optimizer(None, bf16=True)])
    with CountHostSyncs() as syncs:
        chained.prepare_grads()
    counts["bf16", False] = syncs.calls
    expected = {key: ["item", "item"] for key in counts} | {("bf16", False): []}
    assert counts == expected, counts


# --- resume from a checkpoint written with diverged scalers ---------------------------------


def _diverged_state_dict(chained):
    """What unpatched MCore saves after an expert-only overflow and one clean step."""
    state_dict = chained.state_dict()
    diverged = ((8.0, 2, 1), (4.0, 1, 0))
    for state, (scale, growth, hysteresis) in zip(state_dict, diverged, strict=True):
        state["grad_scaler"] = {
            "scale": torch.tensor([scale]),
            "growth_tracker": growth,
            "hysteresis_tracker": hysteresis,
        }
    return state_dict


def case_resume_from_diverged_checkpoint():
    dense, expert = _optimizer(_scaler()), _optimizer(_scaler())
    chained = ChainedOptimizer([dense, expert])
    state_dict = _diverged_state_dict(chained)
    with CaptureLogs() as logs, CountAllReduce() as count:
        chained.load_state_dict(state_dict)
    assert count.calls == 0, "loading must not communicate"
    warnings = logs.messages(WARNING)
    # Every rank loads the same checkpoint: rank 0 speaks, once.
    assert len(warnings) == (1 if dist.get_rank() == 0 else 0), logs.messages()
    assert all("scales in [4, 8]" in w for w in warnings)
    assert _state(dense.grad_scaler) == _state(expert.grad_scaler) == (4.0, 0, 1)
    # The next clean step unscales every chain exactly (before: expert grads 2x).
    _assert_exact_next_step(chained)
    assert _state(dense.grad_scaler) == _state(expert.grad_scaler) == (4.0, 1, 1)


def case_identical_states_load_untouched():
    dense, expert = _optimizer(_scaler()), _optimizer(_scaler())
    chained = ChainedOptimizer([dense, expert])
    assert _step(chained, [False, False]) is True
    with CaptureLogs() as logs:
        chained.load_state_dict(chained.state_dict())
    assert logs.messages(WARNING) == []
    assert _state(dense.grad_scaler) == _state(expert.grad_scaler) == (8.0, 1, 1)


def case_bf16_and_constant_load_unchanged():
    for make in (lambda: None, lambda: ConstantGradScaler(8.0)):
        bf16 = make() is None
        dense, expert = _optimizer(make(), bf16=bf16), _optimizer(make(), bf16=bf16)
        chained = ChainedOptimizer([dense, expert])
        with CaptureLogs() as logs, CountAllReduce() as count:
            chained.load_state_dict(chained.state_dict())
        assert logs.messages(WARNING) == [] and count.calls == 0
        assert _step(chained, [False, False]) is True


def case_collectives_per_path_match_upstream():
    # The chain adds no collective on any path: per prepare_grads() one inf/nan check per
    # chained optimizer with a loss scaler (none in BF16), as upstream; none on load.
    expected = {"fp16_dynamic": (2, 0), "fp16_constant": (2, 0), "bf16": (0, 0)}
    makers = {
        "fp16_dynamic": lambda: _scaler(),
        "fp16_constant": lambda: ConstantGradScaler(8.0),
        "bf16": lambda: None,
    }
    counts = {}
    for path, make in makers.items():
        bf16 = path == "bf16"
        chained = ChainedOptimizer([_optimizer(make(), bf16=bf16), _optimizer(make(), bf16=bf16)])
        _set_grads(chained, [False, True])
        with CountAllReduce() as prepare:
            chained.prepare_grads()
        with count_world_collectives() as load:
            chained.load_state_dict(chained.state_dict())
        counts[path] = (prepare.calls, len(load))
    assert counts == expected, counts


CASES = {name[len("case_") :]: fn for name, fn in globals().items() if name.startswith("case_")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    def init():
        parallel_state.initialize_model_parallel()

    return run_world(CASES, world_size=2, out=tmp_path_factory.mktemp("chained"), init=init)


@pytest.mark.parametrize("name", list(CASES))
def test_chained_loss_scale(results, name):
    check(results, name)
