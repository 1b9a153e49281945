"""Preemption: SIGTERM or SIGINT asks the training loop to finish the current step, save and stop.

A loop observer, so the loop stays free of signals. With several processes the flag is OR-ed over
them after every step, so all processes stop after the same step even when only one got the signal.
A second SIGINT restores Python's default handling (KeyboardInterrupt) for a user in a hurry.

Before the loop, a SIGINT raises KeyboardInterrupt at once, as Python's own handler does, and is also
remembered (`remember_interrupts`): Python drops an exception raised in a garbage-collection callback
or a `__del__` (JAX runs one at every collection), so a Ctrl-C landing there was lost and the run
trained on. The loop then stops before its first step.
"""

import signal
from collections.abc import Callable

from shard.cluster import exchange
from shard.training.observer import Observer

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_early = {"interrupted": False}


def remember_interrupts() -> Callable[[], None]:
    """Until the loop takes the signals: SIGINT raises KeyboardInterrupt and is remembered, so that the
    loop does not start after one was dropped. Returns what puts the previous handler back."""
    _early["interrupted"] = False

    def handle(signum, frame):
        _early["interrupted"] = True
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handle)
    return lambda: signal.signal(signal.SIGINT, previous)


class StopOnSignal(Observer):
    """Observer: `should_stop()` turns true after SIGTERM/SIGINT (on any process); handlers are
    installed for the loop's duration only."""

    def __init__(self, notice: Callable[[str], None] | None = None):
        self.notice = notice or (lambda message: None)
        self.received: str | None = None  # the signal's name, once one arrived here
        self.stopped = False  # the loop was told to stop (this process or another got a signal)
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.received and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.received = self.received or signal.Signals(signum).name  # the first one stopped the run

    def on_start(self, run) -> None:
        if _early["interrupted"]:  # a Ctrl-C before the loop that Python dropped (see the module's doc)
            _early["interrupted"] = False
            raise KeyboardInterrupt
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)

    def should_stop(self) -> bool:
        anywhere = exchange.any_process(self.received is not None, device_collective=True)
        if anywhere and not self.stopped:
            self.stopped = True
            self.notice(f"{self.received or 'a signal on another process'}: finishing this step, "
                        "then saving a checkpoint and stopping")
        return anywhere

    def on_end(self, records: list[dict]) -> None:
        self.on_abort()

    def on_abort(self) -> None:  # the handlers this one replaced come back
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
