"""Progress lines on stderr, timestamped with the seconds since the command started.

On a terminal every step is shown. Otherwise (CI logs, `| tee`) only the long ones
(`long=True`): a line per baseline and per tree state of `prove`, a wait for another run; so a
log never sits silent for minutes, and the other verbs keep to their one-line answers.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, enabled: bool | None = None) -> None:
        """`enabled`: every step shown (None: when stderr is a terminal)."""
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.start = time.monotonic()

    def step(self, message: str, long: bool = False) -> None:
        if self.enabled or long:
            elapsed = time.monotonic() - self.start
            print(f"[{elapsed:6.1f}s] {message}", file=sys.stderr, flush=True)
