"""noxfile.py: `nox -s prove` runs every prove(<baseline>) session; each says which it is."""

from __future__ import annotations

import importlib.util
import sys
import types

from toolworld import MAIN


class Session:
    """What the sessions call on nox's Session, recorded."""

    def __init__(self) -> None:
        self.logs: list[str] = []
        self.runs: list[tuple[str, ...]] = []

    def log(self, message: str) -> None:
        self.logs.append(message)

    def skip(self, message: str) -> None:
        raise AssertionError(f"skipped: {message}")

    def install(self, *args: str) -> None:
        pass

    def run(self, *args: str, **kwargs: object) -> None:
        self.runs.append(args)

    posargs: list[str] = []


def _noxfile(monkeypatch) -> types.ModuleType:
    nox = types.ModuleType("nox")
    nox.options = types.SimpleNamespace()  # type: ignore[attr-defined]
    nox.Session = Session  # type: ignore[attr-defined]
    nox.session = lambda *a, **k: lambda f: f  # type: ignore[attr-defined]
    nox.parametrize = lambda *a, **k: lambda f: f  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nox", nox)
    monkeypatch.setenv("UV_COMPILE_BYTECODE", "1")  # the noxfile sets it in os.environ
    spec = importlib.util.spec_from_file_location("noxfile_under_test", MAIN / "noxfile.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prove_sessions_say_which_of_all_they_are(monkeypatch):
    noxfile = _noxfile(monkeypatch)
    first, n = noxfile.BASELINES[0], len(noxfile.BASELINES)
    session = Session()
    noxfile.prove(session, first)
    assert session.logs[0].startswith(f"baseline {first}: 1 of {n} prove sessions")
    assert "`nox -s prove` runs them all" in session.logs[0]
    assert session.runs == [("python", "-m", "mcore_fixes", "prove", "--baseline", first)]
    assert "all, one by one" in noxfile.prove.__doc__  # what `nox -l` shows
