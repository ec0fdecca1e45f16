"""Proof of patch distopt-index-layout: checkpoints say which param index wrote them.

Groups mixing fp32 and 16-bit params were indexed in grad-buffer order before the index fix
(patch distopt-param-index; upstream #5835 on dev), in storage order after it, and nothing in a
checkpoint said which. The fix records the layout in every checkpoint (`param_index_layout`);
a recorded checkpoint loads through its own index, with no value comparison, no collective and
no warning. An unrecorded one is read in storage order only where its main params fit only that
order, else in grad-buffer order (every release's), decided by one all-reduce for the
data-parallel group, and said in a warning where the values cannot tell (swapped params of
equal values); OptimizerConfig.unrecorded_param_index_layout overrides. Where an unrecorded
reader's grad-buffer-order index would misread the state of some group of the model, on any
pipeline stage, model chunk or expert optimizer, the saved sharding type (legacy: each buffer's
unpadded size, in each rank's own file) carries the record, which such readers refuse: the
common state that torch_dist saves from rank 0 alone says it for every rank.

Real objects: DistributedDataParallel, get_megatron_optimizer (torch Adam), DistributedOptimizer,
ChainedOptimizer, dist_checkpointing save/load to files and the legacy torch.save path, in forked
gloo worlds of 1 and 2 ranks (and 2 ranks at data-parallel size 1, where the swapped shards have
equal sizes; and 2 pipeline stages, where only stage 1 mixes fp32 and 16-bit params, or only
stage 1 has expert params).
Unrecorded checkpoints are written as MCore wrote them: through the grad-buffer-order index it
built (or the storage-order one), without the record. torch_dist checkpoints hold the model
weights too, loaded in the same load as the optimizer state, as megatron/training loads them:
there an fp32 param's main param is its weight, and each must keep its own value (the expert
optimizer of the pipeline case, dp_reshardable, lost one). Disclosed stand-ins:
``CudaOnCpu`` and a no-op ``torch.cuda.synchronize`` for the checkpoint writer.
"""

from __future__ import annotations

import logging

import megatron.core.dist_checkpointing  # noqa: F401 - imported once, before the ranks fork
import megatron.core.distributed  # noqa: F401
import megatron.core.optimizer  # noqa: F401
import pytest
import torch
import torch.distributed as dist
from _support import (
    DISTOPT_LOGGER,
    CaptureLogs,
    CheckpointDirs,
    CountAllReduce,
    CudaSyncOnCpu,
    MixedDtypeNet,
    build_distopt,
    check,
    clone_tensors,
    distopt_formats,
    distopt_load,
    distopt_save_if_writable,
    distopt_step,
    grad_buffer_order_index,
    init_data_parallel,
    init_data_parallel_of_one,
    own_state,
    run_worlds,
    unrecorded,
    world_cases,
)

CKPT = CheckpointDirs()  # shared by the forked ranks
EQUAL = (32, 32, 32)  # equal shapes: the old index saves without a size error
OVERRIDE = "unrecorded_param_index_layout"  # OptimizerConfig field


def _equal_net() -> MixedDtypeNet:
    """Every weight 1.0 (norm weights at their init): swapped params hold equal values."""
    net = MixedDtypeNet(EQUAL)
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(1.0)
    return net


def _assert_own_state(opts, saved, what: str) -> None:
    for opt, before in zip(opts, saved, strict=True):
        for (p, own), expected in zip(own_state(opt).items(), before, strict=True):
            for key, tensor in expected.items():
                assert torch.equal(own[key], tensor), (
                    f"{what}: the {tuple(p.shape)} {p.dtype} param got another param's {key}"
                )


def _round_trip(chunks_fn, sharding_type: str, old_index: bool, recorded: bool, **config):
    """Step, save, step on, load (model weights first; torch_dist: in the optimizer's load, as
    megatron/training loads them); each param must get its own weight and state back. Returns
    the WARNING lines of the load and its all-reduce count, or None (unwritable)."""
    chunks, optimizer, opts = build_distopt(chunks_fn(), **config)
    distopt_step(chunks, optimizer, 0)
    saved = [clone_tensors(list(own_state(opt).values())) for opt in opts]
    weights = clone_tensors([p for chunk in chunks for p in chunk.parameters()])
    ckpt_dir = distopt_save_if_writable(
        CKPT, chunks, optimizer, opts, sharding_type, old_index, recorded, with_model=True
    )
    if ckpt_dir is None:
        return None
    distopt_step(chunks, optimizer, 1)
    with CountAllReduce() as calls:
        messages = distopt_load(chunks, optimizer, opts, sharding_type, ckpt_dir, with_model=True)
    what = f"{sharding_type}, old_index={old_index}"
    _assert_own_state(opts, saved, what)
    for p, weight in zip([p for c in chunks for p in c.parameters()], weights, strict=True):
        assert torch.equal(p, weight), f"{what}: the {tuple(p.shape)} {p.dtype} weight changed"
    return messages, calls.calls


def _formats() -> list[str]:
    return distopt_formats(build_distopt([MixedDtypeNet(EQUAL)])[2][0])


def case_records_its_layout() -> None:
    """In every format; where the old index differs, readers without the record refuse it."""
    for net, guarded in ((MixedDtypeNet(EQUAL), True), (MixedDtypeNet(fp32_first=True), False)):
        chunks, optimizer, opts = build_distopt([net])
        distopt_step(chunks, optimizer, 0)
        (opt,) = opts
        common = opt.state_dict()
        assert common.get("param_index_layout") == "storage_order", sorted(common)
        for sharding_type in _formats():
            if sharding_type == "legacy":
                state = opt.get_parameter_state_dp_zero()
                if state is None:  # not DP rank 0
                    continue
                sizes = [s["numel_unpadded"] for g, d in state.items() if g != "buckets_coalesced"
                         for s in d.values()]  # fmt: skip
                assert any(isinstance(n, dict) for n in sizes) == guarded, sizes
                continue
            metadata = {"distrib_optim_sharding_type": sharding_type}
            try:
                with CudaSyncOnCpu():
                    state = opt.sharded_state_dict(
                        chunks[0].sharded_state_dict(), metadata=metadata
                    )
            except Exception:  # noqa: BLE001 - a format this version cannot write
                continue
            assert state["param_index_layout"] == "storage_order", sharding_type
            kind = state["param_state_sharding_type"]
            assert (kind != sharding_type) == guarded, (sharding_type, kind)
            if guarded:
                _assert_refused_record(kind, sharding_type)


def _assert_refused_record(kind, sharding_type: str) -> None:
    """The saved sharding type carries the record, and why readers without it must refuse."""
    assert isinstance(kind, dict), kind
    assert kind["param_index_layout"] == "storage_order", kind
    assert kind["param_state_sharding_type"] == sharding_type, kind
    assert "param_index_layout" in kind["refused_because"], kind


def case_recorded_checkpoint_loads_exactly_without_check() -> None:
    """No warning, and no more all-reduces than the load of a model whose index never moved."""
    for sharding_type in _formats():
        mixed = _round_trip(lambda: [MixedDtypeNet(EQUAL)], sharding_type, False, True)
        aligned = _round_trip(lambda: [MixedDtypeNet(EQUAL, fp32_first=True)], sharding_type,
                              False, True)  # fmt: skip
        if mixed is None or aligned is None:
            continue
        assert mixed[0] == [], (sharding_type, mixed[0])
        assert mixed[1] == aligned[1], f"{sharding_type}: all-reduces {mixed[1]} vs {aligned[1]}"


def case_recorded_equal_values_load_exactly() -> None:
    """Values that cannot tell the orders apart need nothing when the layout is recorded."""
    for sharding_type in _formats():
        result = _round_trip(lambda: [_equal_net()], sharding_type, False, True, lr=0.0)
        assert result is None or result[0] == [], (sharding_type, result)


def case_release_checkpoint_loads_exactly() -> None:
    """Unrecorded, grad-buffer order (every release): converted, no warning."""
    for sharding_type in _formats():
        result = _round_trip(lambda: [MixedDtypeNet(EQUAL)], sharding_type, True, False)
        assert result is None or result[0] == [], (sharding_type, result)


def case_release_checkpoint_of_equal_values_loads_exactly() -> None:
    """Unrecorded, grad-buffer order, swapped params of equal values (a warmup step at lr 0):
    read in grad-buffer order, and the data-parallel group's first rank (where the optimizer
    lives) says the values could not tell."""
    from megatron.core import parallel_state

    speaks = parallel_state.get_data_parallel_rank() == 0
    for sharding_type in _formats():
        result = _round_trip(lambda: [_equal_net()], sharding_type, True, False, lr=0.0)
        if result is None:
            continue
        messages = result[0]
        assert len(messages) == int(speaks), (sharding_type, messages)
        assert all(OVERRIDE in m and "both orders" in m for m in messages), messages


def case_unrecorded_storage_order_checkpoint_loads_exactly() -> None:
    """Unrecorded, storage order (upstream dev with #5835): its values fit only that order."""
    for sharding_type in _formats():
        result = _round_trip(lambda: [MixedDtypeNet(EQUAL)], sharding_type, False, False)
        assert result is None or result[0] == [], (sharding_type, result)


def case_override_reads_unrecorded_storage_order() -> None:
    """Equal values written in storage order without a record: the optimizer config's
    override reads them."""
    config = {"lr": 0.0, OVERRIDE: "storage_order"}
    result = _round_trip(lambda: [_equal_net()], "legacy", False, False, **config)
    assert result[0] == [], result


def case_vpp_release_checkpoint_loads_exactly() -> None:
    """Two model chunks (VPP), legacy format."""
    chunks = lambda: [MixedDtypeNet(EQUAL), MixedDtypeNet(EQUAL)]  # noqa: E731
    assert _round_trip(chunks, "legacy", True, False)[0] == []


def case_chained_release_checkpoint_loads_exactly() -> None:
    """ChainedOptimizer of two DistributedOptimizers (as dense + expert), legacy format: its own
    save_parameter_state / load_parameter_state, which call each child's dp_zero loader."""
    from megatron.core.optimizer import ChainedOptimizer

    built = [build_distopt([MixedDtypeNet(EQUAL)]) for _ in range(2)]
    chunks = [chunk for b in built for chunk in b[0]]
    opts = [b[2][0] for b in built]
    chain = ChainedOptimizer(opts)
    distopt_step(chunks, chain, 0)
    saved = [clone_tensors(list(own_state(opt).values())) for opt in opts]
    ckpt_dir = CKPT.new("chained")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    weights = [clone_tensors(list(c.parameters())) for c in chunks]
    indexes = [opt.model_param_group_index_map for opt in opts]
    for opt in opts:
        opt.model_param_group_index_map = grad_buffer_order_index(opt)
    try:
        common = unrecorded(clone_tensors(chain.state_dict()))
        chain.save_parameter_state(str(ckpt_dir / f"param_state{dist.get_rank()}.pt"))
    finally:
        for opt, index in zip(opts, indexes, strict=True):
            opt.model_param_group_index_map = index
    dist.barrier()
    distopt_step(chunks, chain, 1)
    with torch.no_grad():
        for chunk, chunk_weights in zip(chunks, weights, strict=True):
            for p, w in zip(chunk.parameters(), chunk_weights, strict=True):
                p.copy_(w)
    with CudaSyncOnCpu(), CaptureLogs(DISTOPT_LOGGER, logging.WARNING) as logs:
        chain.load_state_dict(common)
        chain.load_parameter_state(str(ckpt_dir / f"param_state{dist.get_rank()}.pt"))
    _assert_own_state(opts, saved, "chained legacy")
    assert logs.messages() == [], logs.messages()


def case_same_collectives_on_every_rank() -> None:
    """Data-parallel size 2: every rank issues the same all-reduces in a load, whatever it owns;
    an unrecorded load adds one to a recorded one, an aligned model none."""
    counts = []
    for net, recorded in (
        (MixedDtypeNet(), False),
        (MixedDtypeNet(), True),
        (MixedDtypeNet(fp32_first=True), False),
    ):
        result = _round_trip(lambda net=net: [net], "legacy", False, recorded)
        counts.append(result[1])
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, counts)
    assert all(c == everyone[0] for c in everyone), f"all-reduces per rank: {everyone}"
    assert counts[0] == counts[1] + 1 == counts[2] + 1, f"unrecorded/recorded/aligned: {counts}"


# --- two pipeline stages: only stage 1 mixes fp32 and 16-bit params ----------------------------


def _stage_net(prefix: str, dtypes: tuple[torch.dtype, ...], expert: bool = False):
    """Linears of one width named `prefix`0, 1, ... of `dtypes` (names differ per stage and
    chunk, as layer numbers do); `expert`: expert-parallel params (allreduce=False, as MoE
    experts'), which get_megatron_optimizer gives an optimizer of their own."""
    net = torch.nn.Module()
    gen = torch.Generator().manual_seed(len(prefix) + len(dtypes))
    for i, dtype in enumerate(dtypes):
        layer = torch.nn.Linear(32, 32)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
                p.allreduce = not expert
        setattr(net, f"{prefix}{i}", layer.to(dtype))
    return net


BF16, FP32 = torch.bfloat16, torch.float32


def _last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank() == 1


def _pp_chunks() -> list:
    """One chunk per stage; stage 1 puts an fp32 Linear among bf16 ones (an fp32 final norm)."""
    stage = int(_last_stage())
    return [_stage_net(f"s{stage}_", (BF16, FP32 if stage else BF16, BF16))]


def _vpp_chunks() -> list:
    """Two chunks per stage, each of one dtype: stage 1's second chunk is fp32, so the group
    of both chunks mixes fp32 and 16-bit params (virtual pipeline parallelism)."""
    stage = int(_last_stage())
    second = FP32 if stage else BF16
    return [_stage_net(f"s{stage}c0_", (BF16, BF16)), _stage_net(f"s{stage}c1_", (second,) * 2)]


def _ep_chunks() -> list:
    """Dense and expert Linears: only stage 1's expert optimizer mixes fp32 and bf16 params."""
    stage = int(_last_stage())
    net = _stage_net(f"s{stage}_dense", (BF16, BF16))
    expert = _stage_net(f"s{stage}_expert", (BF16, FP32 if stage else BF16, BF16), expert=True)
    for name, layer in expert.named_children():
        setattr(net, name, layer)
    return [net]


PIPELINES = {"pp": _pp_chunks, "vpp": _vpp_chunks, "ep": _ep_chunks}


def _on_every_rank(check, what: str) -> None:
    """Run `check` on every rank and fail on every rank where it failed on one: a rank that
    went on alone would wait in the next collective for one that stopped."""
    try:
        check()
        error = ""
    except Exception as e:  # noqa: BLE001 - reported below, on every rank
        error = f"{type(e).__name__}: {e}"
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = {rank: e for rank, e in enumerate(errors) if e}
    assert not failed, f"{what}: {failed}"


def case_pipeline_refusal_decided_for_the_whole_model() -> None:
    """Every rank's saved sharding type carries the record of the optimizer that mixes on some
    stage, stage 0 too: torch_dist saves rank 0's common state for every rank."""
    for name, chunks_fn in PIPELINES.items():
        chunks, optimizer, opts = build_distopt(chunks_fn())
        distopt_step(chunks, optimizer, 0)
        model_sd = {k: v for chunk in chunks for k, v in chunk.sharded_state_dict().items()}
        for sharding_type in {"dp_reshardable", "fully_reshardable"} & set(_formats()):
            metadata = {"distrib_optim_sharding_type": sharding_type}
            with CudaSyncOnCpu():
                state = optimizer.sharded_state_dict(model_sd, metadata=metadata)
            states = [state[i] for i in range(len(opts))] if len(opts) > 1 else [state]

            def check(states=states, sharding_type=sharding_type, name=name) -> None:
                for opt_index, opt_state in enumerate(states):
                    kind = opt_state["param_state_sharding_type"]
                    if name == "ep" and opt_index == 0:  # the dense optimizer mixes nowhere
                        assert kind == sharding_type, (name, kind)
                    else:
                        _assert_refused_record(kind, sharding_type)

            _on_every_rank(check, f"{name}, {sharding_type}")


def case_pipeline_checkpoints_load_exactly() -> None:
    """Recorded (the fork's) and unrecorded grad-buffer-order (the releases') checkpoints of
    pipeline stages that differ load exactly, with no warning."""
    for name in ("pp", "ep"):  # two chunks per stage: the refusal case above
        chunks_fn = PIPELINES[name]
        for sharding_type in {"dp_reshardable", "fully_reshardable", "legacy"} & set(_formats()):
            for old_index, recorded in ((False, True), (True, False)):

                def check(fn=chunks_fn, kind=sharding_type, old=old_index, rec=recorded) -> None:
                    result = _round_trip(fn, kind, old, rec)
                    assert result is None or result[0] == [], result

                _on_every_rank(check, f"{name}, {sharding_type}, recorded={recorded}")


def case_pipeline_stage_without_experts_saves() -> None:
    """Expert params on stage 1 only (a MoE model whose first layers are dense). Before 0.14
    stage 0 then has no expert optimizer, one DistributedOptimizer fewer than stage 1: its save
    must still issue the collectives stage 1 issues (no rank waits alone), and what stage 0
    saves for every rank still refuses readers without the record (stage 1's expert optimizer
    mixes). Where every stage has the same optimizers (param-group keys gathered across
    ranks, 0.14 and later), the cases above cover it."""
    stage = int(_last_stage())
    net = _stage_net(f"s{stage}_dense", (BF16, BF16))
    if stage:
        expert = _stage_net("s1_expert", (BF16, FP32, BF16), expert=True)
        for name, layer in expert.named_children():
            setattr(net, name, layer)
    chunks, optimizer, opts = build_distopt([net])
    counts: list = [None] * dist.get_world_size()
    dist.all_gather_object(counts, len(opts))
    if len(set(counts)) == 1:
        return
    distopt_step(chunks, optimizer, 0)
    metadata = {"distrib_optim_sharding_type": "dp_zero_gather_scatter"}

    def check() -> None:
        with CudaSyncOnCpu():
            state = optimizer.sharded_state_dict(chunks[0].sharded_state_dict(), metadata=metadata)
        for opt_state in [state[i] for i in range(len(opts))] if len(opts) > 1 else [state]:
            _assert_refused_record(
                opt_state["param_state_sharding_type"], metadata["distrib_optim_sharding_type"]
            )

    _on_every_rank(check, f"stages with {counts} DistributedOptimizers")


def init_two_stages() -> None:
    """``init`` for run_world: two pipeline stages, data-parallel size 1."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)


UNRECORDED = {
    "release_checkpoint_loads_exactly": case_release_checkpoint_loads_exactly,
    "release_checkpoint_of_equal_values_loads_exactly": (
        case_release_checkpoint_of_equal_values_loads_exactly
    ),
    "vpp_release_checkpoint_loads_exactly": case_vpp_release_checkpoint_loads_exactly,
    "chained_release_checkpoint_loads_exactly": case_chained_release_checkpoint_loads_exactly,
    "unrecorded_storage_order_checkpoint_loads_exactly": (
        case_unrecorded_storage_order_checkpoint_loads_exactly
    ),
    "override_reads_unrecorded_storage_order": case_override_reads_unrecorded_storage_order,
}
RECORDED = {
    "records_its_layout": case_records_its_layout,
    "recorded_checkpoint_loads_exactly_without_check": (
        case_recorded_checkpoint_loads_exactly_without_check
    ),
    "recorded_equal_values_load_exactly": case_recorded_equal_values_load_exactly,
}
WORLDS = {
    "dp1": (1, init_data_parallel, {**RECORDED, **UNRECORDED}),
    "dp2": (
        2,
        init_data_parallel,
        {
            "recorded_checkpoint_loads_exactly_without_check": (
                case_recorded_checkpoint_loads_exactly_without_check
            ),
            "same_collectives_on_every_rank": case_same_collectives_on_every_rank,
        },
    ),
    "2ranks-dp1": (2, init_data_parallel_of_one, UNRECORDED),
    "pp2": (
        2,
        init_two_stages,
        {
            "pipeline_refusal_decided_for_the_whole_model": (
                case_pipeline_refusal_decided_for_the_whole_model
            ),
            "pipeline_checkpoints_load_exactly": case_pipeline_checkpoints_load_exactly,
            "pipeline_stage_without_experts_saves": case_pipeline_stage_without_experts_saves,
        },
    ),
}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    return run_worlds(WORLDS, tmp_path_factory, after=CKPT.remove)


WORLD_CASES = world_cases(WORLDS)


@pytest.mark.parametrize(("world", "case"), WORLD_CASES, ids=[f"{w}-{c}" for w, c in WORLD_CASES])
def test_distopt_index_layout(worlds, world, case) -> None:
    check(worlds[world], case)
