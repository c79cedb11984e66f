"""Ctrl-C: the first one stops the loop after the step in progress, a second one at once."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def stop_after_step_on_sigint():
    """Turns the first Ctrl-C (SIGINT) into a request to stop after the step in progress.

    Yields a function that says whether a stop was requested. A second Ctrl-C interrupts at
    once (`KeyboardInterrupt`). Outside the main thread, where Python cannot install signal
    handlers, Ctrl-C always interrupts at once.
    """
    requested: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return

    def handler(signum, frame):
        del signum, frame
        if requested:
            raise KeyboardInterrupt
        requested.append(True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(requested)
    finally:
        signal.signal(signal.SIGINT, previous)
