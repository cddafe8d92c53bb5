"""A process-wide PyTorch setting turned off while any of t2j_ad's calls, on
any thread, needs it off (PyTorch's attention fast path, cuDNN)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class HeldOff:
    """Off while anyone holds it (``off`` / ``back``, or a ``with`` block);
    back to what it was before the first hold when the last ends. The count
    is under a lock: holds on several threads nest."""

    def __init__(self, read: Callable[[], bool], write: Callable[[bool], None]) -> None:
        self._read, self._write = read, write
        self._lock = threading.Lock()
        self._held = 0
        self._was = True

    def off(self) -> None:
        with self._lock:
            if not self._held:
                self._was = self._read()
                self._write(False)
            self._held += 1

    def back(self) -> None:
        with self._lock:
            self._held -= 1
            if not self._held:
                self._write(self._was)

    def __enter__(self) -> None:
        self.off()

    def __exit__(self, *exc: object) -> None:
        self.back()
