"""The benchmark's progress bar: tqdm when installed, else a one-line bar on stderr."""

from __future__ import annotations

import sys


class Progress:
    """``total`` steps; ``step(label)`` says what runs next, ``advance()`` counts one done."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled, self._tqdm = total, 0, enabled, None
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self._tqdm = tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True, leave=False)
        except ImportError:
            pass

    def step(self, label: str) -> None:
        """Say what runs next."""
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.set_description_str(label)
            return
        n = 30
        fill = n * self.done // max(self.total, 1)
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (n - fill)}] {self.done}/{self.total} {label[:60]:60}")
        sys.stderr.flush()

    def advance(self) -> None:
        self.done += 1
        if self._tqdm is not None:
            self._tqdm.update(1)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self.enabled:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()
