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
