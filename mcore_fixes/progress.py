"""Progress lines for long verbs: shown on a terminal, silent when stderr is not a TTY."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.start = time.monotonic()

    def step(self, message: str) -> None:
        if self.enabled:
            elapsed = time.monotonic() - self.start
            print(f"[{elapsed:6.1f}s] {message}", file=sys.stderr, flush=True)
