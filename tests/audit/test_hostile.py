"""`audit` on files of unknown origin: no code run, bounded memory and time, read-only, and one
line (exit status 2; JSON with --json) for anything that is not what Megatron writes.

Every file here is made by the test (hostile.py): pickles with strides, sizes and offsets that
point outside their storage, structures nested deep or holding themselves, FIFOs, devices and
paths leading out of the checkpoint. Each run is a subprocess with a time limit and an address
space limit: a hang, a runaway allocation or a crash fails the test, not the machine.
"""

from __future__ import annotations

import json
import math
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from hostile import Build, Global, Raw, Reduce, dumps, metadata, obj, tensor, torch_save

from mcore_fixes.audit import ckptread
from mcore_fixes.audit.ckptread import PICKLE_MAX

LIMIT_AS = 2 << 30  # bytes of address space a run may take (numpy alone needs a few hundred MB)


def audit(path: Path | str | bytes, *extra: str, timeout: int = 60) -> tuple[int, str, str]:
    """`python -m mcore_fixes audit PATH` in a subprocess, limited in time and memory."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))

    env = {**os.environ, "LC_ALL": "C.UTF-8"}
    env.pop("PYTHONIOENCODING", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "mcore_fixes", "audit", path, *extra],
            cwd=ROOT, env=env, capture_output=True, timeout=timeout, preexec_fn=limit,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise AssertionError(f"audit of {path!r} still running after {timeout} s") from None
    out = proc.stdout.decode("utf-8", "replace")
    return proc.returncode, out, proc.stderr.decode("utf-8", "replace")


def refused(path: Path | str | bytes, *needles: str) -> str:
    """The audit of `path` is one line naming what is wrong, exit status 2; with --json, JSON."""
    code, out, err = audit(path)
    assert code == 2, (code, out, err)
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("mcore_fixes: error: "), err
    for needle in needles:
        assert needle in err, err
    code, out, err = audit(path, "--json")
    assert code == 2 and "Traceback" not in err, (code, err)
    assert json.loads(out)["error"] == err.removeprefix("mcore_fixes: error: ").strip()
    return err


def scaler(scale) -> dict:
    return {"scale": scale, "growth_tracker": 0, "hysteresis_tracker": 2}


def legacy(
    root: Path, extra: dict | None = None, storages: dict | None = None, name: str = "iter_0000001"
) -> Path:
    """A torch-format checkpoint (root/name/model_optim_rng.pt) with one model weight, one
    loss scaler and `extra` keys; its storages "0" (4 floats) and "1" (the scale) and
    `storages`."""
    data = {
        "iteration": 1,
        "model": {"w": tensor("0", 4, (4,), (1,))},
        "optimizer": {"grad_scaler": scaler(tensor("1", 1, (), ()))},
        **(extra or {}),
    }
    records = {"0": struct.pack("<4f", 1, 2, 3, 4), "1": struct.pack("<f", 8.0), **(storages or {})}
    torch_save(root / name / "model_optim_rng.pt", dumps(data), records)
    return root / name


def dist(root: Path, items: dict[str, dict], files: dict[str, bytes] | None = None) -> Path:
    """A torch_dist checkpoint: `.metadata` of object items and the files it names."""
    ckpt = root / "iter_0000001"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(metadata(items))
    for name, data in (files or {}).items():
        (ckpt / name).write_bytes(data)
    return ckpt


def test_a_made_checkpoint_is_read(tmp_path):
    """The files below differ from this one only in what each test makes hostile."""
    code, out, err = audit(legacy(tmp_path))
    assert code == 0 and err == "", err
    assert "loss-scale: ok: 1 dynamic loss scaler(s), all at (scale 8," in out


# --- memory safety: a tensor's view is checked against its storage --------------------------


@pytest.mark.parametrize(
    ("numel", "size", "stride", "offset"),
    [
        (1, (2, 2), (1 << 40, -(1 << 40)), 0),  # huge and negative: a span of one element
        (4, (2,), (-1,), 1),  # a negative stride reads before the buffer
        (4, (3,), (1 << 61,), 0),  # past the storage
        (4, (2, 2), (2, 1), 1),  # one element past the storage
        (4, (4,), (1,), -1),  # a negative offset
        (1, (1 << 40,), (0,), 0),  # more elements than the storage (time)
        (4, (2,), ("1",), 0),  # not a number
    ],
    ids=["huge-neg", "negative", "huge", "one-past", "negative-offset", "expanded", "string"],
)
def test_strides_outside_the_storage_are_refused(tmp_path, numel, size, stride, offset):
    scale = tensor("1", numel, size, stride, offset)
    ckpt = legacy(tmp_path, {"optimizer": {"grad_scaler": scaler(scale)}}, {"1": bytes(16)})
    refused(ckpt, "model_optim_rng.pt", "a tensor ")


def test_a_storage_larger_than_its_record_is_refused(tmp_path):
    ckpt = legacy(tmp_path, {"model": {"w": tensor("0", 1 << 30, (1 << 30,), (1,))}})
    refused(ckpt, "model_optim_rng.pt", "storage 0 of 1073741824 float32 elements is larger")


def test_a_non_contiguous_tensor_reads_its_own_elements(tmp_path):
    """A transposed view (strides checked, then indexed): the values of its elements."""
    w = tensor("0", 4, (2, 2), (1, 2))
    ckpt = legacy(tmp_path, {"model": {"w": w}, "optimizer": {"grad_scaler": scaler(w)}})
    code, out, err = audit(ckpt)
    assert code == 0 and "(scale 1," in out, out + err


# --- bounded time and memory ----------------------------------------------------------------


@pytest.mark.parametrize("name", [".metadata", "model_optim_rng.pt"])
def test_a_fifo_is_refused_at_once(tmp_path, name):
    ckpt = tmp_path / "iter_0000001"
    ckpt.mkdir()
    os.mkfifo(ckpt / name)
    refused(ckpt, name, "not a regular file (a FIFO)")


def test_metadata_linked_to_a_device_is_refused(tmp_path):
    ckpt = tmp_path / "iter_0000001"
    ckpt.mkdir()
    (ckpt / ".metadata").symlink_to("/dev/zero")
    refused(ckpt, "leads outside the checkpoint")
    (ckpt / ".metadata").unlink()
    (ckpt / "zero").symlink_to("/dev/zero")
    (ckpt / ".metadata").symlink_to("zero")
    refused(ckpt, "leads outside the checkpoint")


def test_metadata_larger_than_the_bound_is_refused_unread(tmp_path):
    ckpt = tmp_path / "iter_0000001"
    ckpt.mkdir()
    with open(ckpt / ".metadata", "wb") as f:
        f.truncate(PICKLE_MAX + 1)  # sparse: no disk used
    refused(ckpt, ".metadata", f"more than the {PICKLE_MAX} it may have")


@pytest.mark.parametrize("builtin", ["bytearray", "bytes"])
def test_a_pickle_cannot_size_what_it_builds(tmp_path, builtin):
    """A few hundred bytes asked for gigabytes (`bytearray(n)`): refused, nothing allocated."""
    bomb = Reduce(Global("builtins", builtin), (3 << 30,))
    refused(legacy(tmp_path, {"blob": bomb}), "model_optim_rng.pt", "a size the file gives")


def test_a_pickle_cannot_build_a_range(tmp_path):
    """`set(range(n))` would allocate n elements: range is an object the reader does not build."""
    bomb = Reduce(Global("builtins", "set"), (Reduce(Global("builtins", "range"), (1 << 40,)),))
    refused(legacy(tmp_path, {"blob": bomb}), "model_optim_rng.pt", "cannot unpickle")


def test_a_list_holding_itself_ends(tmp_path):
    loop = Raw(b"]q\x07h\x07a")  # a list, memoized, appended to itself
    code, out, err = audit(legacy(tmp_path, {"loop": loop, "pair": [loop, loop]}), timeout=30)
    assert code == 0 and "loss-scale: ok" in out, out + err


def test_deep_nesting_is_one_line(tmp_path):
    deep = Raw(b"]" * 100_000 + b"a" * 99_999)  # 100000 lists, each in the one before
    refused(legacy(tmp_path, {"deep": deep}), "model_optim_rng.pt", "nested more than 100")


# --- only the checkpoint's own files --------------------------------------------------------


@pytest.mark.parametrize("relative_path", ["../outside.distcp", "/etc/hostname", "a/../../x", ""])
def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, relative_path):
    (tmp_path / "outside.distcp").write_bytes(b"\0" * 64)
    info = {"relative_path": relative_path, "offset": 0, "length": 8}
    refused(dist(tmp_path, {"common": info}), ".metadata", "is not a path inside the checkpoint")


def test_a_chunk_file_linked_outside_the_checkpoint_is_refused(tmp_path):
    (tmp_path / "outside.distcp").write_bytes(b"\0" * 64)
    ckpt = dist(tmp_path, {"common": {"relative_path": "0.distcp", "offset": 0, "length": 8}})
    (ckpt / "0.distcp").symlink_to(tmp_path / "outside.distcp")
    refused(ckpt, "0.distcp leads outside the checkpoint")


# --- one line, never a traceback -------------------------------------------------------------


@pytest.mark.parametrize(
    "offset", ["abc", None, -1, 1.5, 10**5000], ids=["str", "none", "neg", "float", "huge"]
)
def test_non_numeric_offsets_in_metadata(tmp_path, offset):
    info = {"relative_path": "0.distcp", "offset": offset, "length": 8}
    ckpt = dist(tmp_path, {"common": info}, {"0.distcp": b"\0" * 64})
    refused(ckpt, ".metadata", "offset or length of a chunk in 0.distcp")


def test_chunk_offsets_that_are_not_numbers(tmp_path):
    mod = "torch.distributed.checkpoint.metadata"
    chunk = obj(f"{mod}.ChunkStorageMetadata", {"offsets": "ab", "sizes": (2,)})
    md = obj(f"{mod}.TensorStorageMetadata", {"chunks": [chunk], "size": (2,)})
    index = obj(f"{mod}.MetadataIndex", {"fqn": "w", "offset": (0,)})
    info = obj("x._StorageInfo", {"relative_path": "0.distcp", "offset": 0, "length": 8})
    meta = obj(f"{mod}.Metadata", {"state_dict_metadata": {"w": md}, "storage_data": {index: info}})
    ckpt = tmp_path / "iter_0000001"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(dumps(meta))
    (ckpt / "0.distcp").write_bytes(b"\0" * 8)
    refused(ckpt, ".metadata", "a chunk offset of w is not a list of non-negative integers")


@pytest.mark.parametrize("iteration", [10**5000, -5], ids=["huge", "negative"])
def test_an_iteration_no_run_reaches(tmp_path, iteration):
    refused(legacy(tmp_path, {"iteration": iteration}), "model_optim_rng.pt", "iteration")


@pytest.mark.parametrize(
    "text", ["9" * 5000, "\u00b2", "\u0663", "1\n2"], ids=["huge", "sup2", "arabic3", "lines"]
)
def test_a_tracker_that_is_not_an_iteration_number(tmp_path, text):
    legacy(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(text)
    refused(tmp_path, "latest_checkpointed_iteration.txt")


def test_an_iteration_directory_of_unicode_digits_is_not_one(tmp_path):
    ckpt = legacy(tmp_path, {"iteration": None}, name="iter_\u00b2")
    code, out, err = audit(ckpt)
    assert code == 0 and out.startswith(f"{ckpt}: torch checkpoint\n"), out + err
    refused(tmp_path, "not a Megatron checkpoint")


def test_a_directory_name_that_is_not_utf8(tmp_path):
    ckpt = legacy(Path(os.fsdecode(bytes(tmp_path) + b"/save-\xff")))
    code, out, err = audit(bytes(ckpt))
    assert code == 0 and "Traceback" not in err, err
    assert out.startswith(f"{tmp_path}/save-\\udcff/iter_0000001: torch checkpoint"), out
    code, out, err = audit(bytes(ckpt), "--json")
    assert code == 0 and json.loads(out)["checkpoint"].endswith("save-\udcff/iter_0000001")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_json_of_a_non_finite_loss_scale(tmp_path, value):
    ckpt = legacy(tmp_path, storages={"1": struct.pack("<f", value)})
    code, out, err = audit(ckpt, "--json")
    assert code == 0, err

    def no_constant(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    report = json.loads(out, parse_constant=no_constant)
    (found,) = report["checks"][0]["evidence"]["scalers"]
    assert found["scale"] == {"nan": "NaN", "inf": "Infinity"}.get(str(value), "-Infinity")


def test_json_of_a_path_that_is_no_checkpoint(tmp_path):
    for path in (tmp_path / "missing", tmp_path):
        err = refused(path)
        assert str(path) in err
    refused(tmp_path / ("a" * 5000), "File name too long")  # an OSError, not ours


def test_args_of_any_shape_in_the_evidence(tmp_path):
    """What a checkpoint's args hold goes into --json as JSON, whatever its type."""
    args = Build(Reduce(Global("argparse", "Namespace"), ()), {
        "overlap_grad_reduce": Reduce(Global("builtins", "set"), ([1, 2],)),
        "ddp_bucket_size": 10**30,
        "dist_ckpt_optim_fully_reshardable": math.nan,
    })  # fmt: skip
    code, out, err = audit(legacy(tmp_path, {"args": args}), "--json")
    assert code == 0, err
    json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))


def test_a_dict_key_nested_a_million_deep_does_not_crash_the_audit(tmp_path):
    """The C unpickler hashes a key as it builds the dict, recursing with no limit: the crash
    happens in a child process, the audit says so in one line."""
    key = Raw(b")" + b"\x85" * 1_000_000)  # (((...(),),),) as a key
    bomb = Raw(b"}" + key.ops + b"K\x01s")
    refused(legacy(tmp_path, {"blob": bomb}), "model_optim_rng.pt", "crashes the reader")


def test_a_key_that_takes_exponential_time_to_hash_is_stopped(tmp_path, monkeypatch):
    """t = (t, t) forty times over: 2**40 steps to hash, a few hundred bytes to write."""
    monkeypatch.setattr(ckptread, "UNPICKLE_SECONDS", 2)
    doubled = b")q\x000" + b"h\x00h\x00\x86q\x000" * 40 + b"h\x00"  # memo 0: t
    data = b"\x80\x02}" + doubled + b"K\x01s."
    with pytest.raises(ckptread.BadCheckpoint, match="unpickling it takes more than 2 s"):
        ckptread.unpickle(data, where="x.pkl")
