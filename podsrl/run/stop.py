"""SIGTERM and SIGINT while a run trains: finish the step in flight, checkpoint, exit cleanly, nothing lost. Episodes
waiting on their environments are abandoned at once (episodes.calls.STOP), the last completed step checkpointed: a
hung tool cannot hold the exit. Under torchrun the ranks must stop at the same point, so their step finishes
(environment calls are bounded by their time limits). A second Ctrl-C aborts at once."""

from __future__ import annotations

import signal

from podsrl.episodes.calls import STOP

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """While entered, the signals above request a stop (`requested`) instead of killing the process; on exit the
    handlers before it are back."""

    def __init__(self, distributed: bool) -> None:
        self.distributed = distributed
        self.requested = False
        self.previous: dict = {}

    def __enter__(self) -> StopSignals:
        self.previous = {s: signal.signal(s, self._request) for s in SIGNALS}
        STOP.clear()
        return self

    def __exit__(self, *exc) -> None:
        STOP.clear()
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _request(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        if not self.distributed:
            STOP.set()
