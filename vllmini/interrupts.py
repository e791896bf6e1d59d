"""Ctrl-C at a safe moment: an engine step is all-or-nothing, so a KeyboardInterrupt may roll a step back
but must not land half-way through its commit."""

from __future__ import annotations

import signal
import threading


class DeferSigint:
    """Within `with`: Ctrl-C raises KeyboardInterrupt as usual until `hold()`; after that it is only
    recorded in `.interrupted`, for the caller to act on once the critical part is done."""

    def __init__(self, hold: bool = False):
        self.holding, self.interrupted = hold, False
        self._previous = None

    def hold(self) -> None:
        self.holding = True

    def _handler(self, signum, frame):
        if self.holding:
            self.interrupted = True
        elif self._previous is not signal.SIG_IGN:
            self.holding = True  # a second Ctrl-C must not interrupt the rollback of the first
            if callable(self._previous):
                self._previous(signum, frame)  # Python's default handler raises KeyboardInterrupt
            else:
                raise KeyboardInterrupt

    def __enter__(self) -> DeferSigint:
        if threading.current_thread() is threading.main_thread():  # only it receives signals
            previous = signal.signal(signal.SIGINT, self._handler)
            self._previous = signal.SIG_DFL if previous is None else previous  # None: set outside Python
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
