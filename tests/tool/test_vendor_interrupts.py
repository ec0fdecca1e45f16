"""An interrupted `vendor` never leads `export` to rewrite patches; broken state is one line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from test_bad_input import one_line
from toolworld import MAIN, run_module, tree_snapshot


def test_vendor_killed_at_any_moment_never_corrupts_patches(project):
    patches = tree_snapshot(project / "patches")
    assert run_module(project, "vendor").rc == 0
    for i, delay in enumerate((0.1, 0.2, 0.3, 0.45)):
        baseline = ("core_v0.1.1", "0.1.0")[i % 2]  # other files each time
        proc = subprocess.Popen(
            [sys.executable, "-m", "mcore_fixes", "--root", str(project), "vendor", "--force"]
            + ["--baseline", baseline],
            cwd=MAIN,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        time.sleep(delay)
        try:
            proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        r = run_module(project, "export")
        assert r.rc in (0, 1, 2), r.err
        if r.rc:  # refused: a half-written tree is never exported
            assert "interrupted `vendor`" in r.err or "no vendored tree" in r.err, r.err
        else:
            assert "updated" not in r.out, r.out
        assert tree_snapshot(project / "patches") == patches
        r = run_module(project, "vendor", "--baseline", baseline)  # recovers without --force
        assert r.rc == 0, r.err
    r = run_module(project, "export")
    assert r.rc == 0 and "updated" not in r.out
    assert tree_snapshot(project / "patches") == patches


def test_half_replaced_tree_is_redone_not_exported(project, tool):
    """The state a kill during the replacement of megatron/ leaves, exactly."""
    assert tool(project, "vendor").rc == 0
    state = project / "build" / "vendor.json"
    data = json.loads(state.read_text())
    state.write_text(json.dumps({**data, "incomplete": True, "files": {}}))
    for path in sorted((project / "megatron").rglob("*.py"))[::2]:
        path.unlink()
    patches = tree_snapshot(project / "patches")
    r = tool(project, "export")
    assert r.rc == 1 and "interrupted `vendor`" in one_line(r.err)
    assert tree_snapshot(project / "patches") == patches
    r = tool(project, "vendor")
    assert r.rc == 0, r.err
    r = tool(project, "export")
    assert r.rc == 0 and "updated" not in r.out
    assert tree_snapshot(project / "patches") == patches


def test_export_with_a_missing_patch_file_writes_nothing(project, tool):
    assert tool(project, "vendor").rc == 0
    (project / "patches" / "0001-fix-mean.patch").unlink()
    patches = tree_snapshot(project / "patches")
    r = tool(project, "export")
    assert r.rc == 1
    msg = one_line(r.err)
    assert "0001-fix-mean.patch" in msg and "nothing was written" in msg
    assert tree_snapshot(project / "patches") == patches


def test_corrupt_vendor_state(project, tool):
    assert tool(project, "vendor").rc == 0
    state = project / "build" / "vendor.json"
    before = tree_snapshot(project / "megatron")
    for corrupt in (b"{not json", b"\xff\xfe", b"[]", b'{"baseline": "0.1.0"}'):
        state.write_bytes(corrupt)
        for verb in ("vendor", "export"):
            r = tool(project, verb)
            assert r.rc == 2, (corrupt, verb, r.err)
            assert "is corrupt" in one_line(r.err) and "vendor --force" in r.err
        assert tree_snapshot(project / "megatron") == before
    r = tool(project, "vendor", "--force")
    assert r.rc == 0, r.err
    assert tool(project, "export").rc == 0
