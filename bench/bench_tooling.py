"""Tooling cost on this machine: vendor (cold/warm cache), apply, one baseline's tests, CI.

Prints one table; every figure is measured in this run. The floor is what any test process
pays before it does anything: interpreter start, `import torch`, `import megatron.core`.

    python bench/bench_tooling.py --python .nox/prove-0-16-1/bin/python \
        [--mcore-repo ~/Megatron-LM] [--baseline 0.16.1 ...] [--ci]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(cmd: list[str], **kwargs: object) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return elapsed


def tool(root: Path, *args: str, python: str = sys.executable) -> list[str]:
    return [python, "-m", "mcore_fixes", "--root", str(root), *args]


def scratch_root(tmp: Path) -> Path:
    """A project root with our patches but an empty build/ (and so no cached trees)."""
    root = tmp / "root"
    shutil.copytree(ROOT / "patches", root / "patches")
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="interpreter with torch and pytest")
    parser.add_argument("--mcore-repo", help="Megatron-LM checkout (git baselines, apply)")
    parser.add_argument("--baseline", action="append", help="baselines to vendor")
    parser.add_argument("--ci", action="store_true", help="also time `nox` on a fresh clone")
    args = parser.parse_args()
    baselines = args.baseline or ["0.13.1", "0.14.0", "0.15.3", "0.16.1"]
    if args.mcore_repo:
        baselines += ["core_v0.19.0", "main"]
    repo = ["--mcore-repo", args.mcore_repo] if args.mcore_repo else []
    rows: list[tuple[str, float, str]] = []

    floor_py = timed([args.python, "-c", "pass"])
    floor_torch = timed([args.python, "-c", "import torch"])
    rows += [("interpreter start", floor_py, "floor"), ("import torch", floor_torch, "floor")]

    with tempfile.TemporaryDirectory() as tmp_str:
        tmp = Path(tmp_str)
        env = {**os.environ, "MCORE_FIXES_CACHE": str(tmp / "cache")}
        root = scratch_root(tmp)
        for name in baselines:
            cold = timed(
                tool(root, "vendor", "--force", "--baseline", name, *repo), cwd=ROOT, env=env
            )
            warm = timed(
                tool(root, "vendor", "--force", "--baseline", name, *repo), cwd=ROOT, env=env
            )
            rows += [(f"vendor {name} (cold cache)", cold, "download/extract + git am")]
            rows += [(f"vendor {name} (warm cache)", warm, f"{cold / warm:.1f}x faster than cold")]
        tree = root / "build" / "trees" / "0.16.1"
        imp = timed(
            [args.python, "-c", "import megatron.core.optimizer"],
            env={**os.environ, "PYTHONPATH": str(tree)},
        )
        rows.append(("import megatron.core.optimizer (0.16.1)", imp, "floor"))
        floor = floor_torch + imp
        test = timed(tool(root, "test", "--baseline", "0.16.1", python=args.python), cwd=ROOT)
        rows.append(("test 0.16.1 (all patch tests)", test, f"{test / floor:.1f}x the floor"))
        if args.mcore_repo:
            checkout = tmp / "checkout"
            subprocess.run(["git", "clone", "-q", "--shared", args.mcore_repo, str(checkout)])
            subprocess.run(["git", "-C", str(checkout), "checkout", "-q", "core_v0.19.0"])
            apply = timed(tool(root, "apply", str(checkout)), cwd=ROOT)
            again = timed(tool(root, "apply", str(checkout)), cwd=ROOT)
            rows += [("apply to core_v0.19.0 checkout", apply, "target < 2 s")]
            rows += [("apply again (no-op)", again, "")]
        if args.ci:
            clone = tmp / "clone"
            subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
            ci = timed(["nox"], cwd=clone)
            rows.append(("CI: nox on a fresh clone", ci, "target < 600 s"))

    width = max(len(r[0]) for r in rows)
    print(f"{'step':<{width}}  {'seconds':>8}  note")
    print(f"{'-' * width}  {'-' * 8}  ----")
    for name, seconds, note in rows:
        print(f"{name:<{width}}  {seconds:8.2f}  {note}")


if __name__ == "__main__":
    main()
