"""examples/lm/interrupt.py: the first Ctrl-C asks the loop to stop, a second one interrupts."""

import pathlib
import signal
import sys
import threading

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from lm.interrupt import stop_after_step_on_sigint  # noqa: E402


def test_first_sigint_asks_to_stop_the_second_interrupts():
    before = signal.getsignal(signal.SIGINT)
    with stop_after_step_on_sigint() as stop_requested:
        assert not stop_requested()
        signal.raise_signal(signal.SIGINT)
        assert stop_requested()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_handler_is_put_back_after_an_error():
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError, match="in the loop"):
        with stop_after_step_on_sigint():
            raise RuntimeError("in the loop")
    assert signal.getsignal(signal.SIGINT) is before


def test_outside_the_main_thread_nothing_is_installed():
    seen = []

    def run():
        with stop_after_step_on_sigint() as stop_requested:
            seen.append((stop_requested(), signal.getsignal(signal.SIGINT)))

    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [(False, before)]
