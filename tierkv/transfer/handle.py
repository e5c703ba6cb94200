"""The completion of one enqueued transfer, and what a transfer may wait for.

Primitives:
    TransferHandle   one enqueued transfer: wait_on_current_stream, is_done, synchronize
    After            what `after=` takes: events, handles, a sequence of them, or None
    events_of        the events an `After` names
"""

from __future__ import annotations

from typing import Sequence, Union

import torch


class TransferHandle:
    """One enqueued transfer.

    `event` is recorded on the copy stream after the copy (None on a CPU engine). It belongs
    to the handle and goes back to the engine's pool when the handle is garbage-collected:
    use it through the handle, do not keep it longer.
    """

    def __init__(self, event: torch.cuda.Event | None, num_bytes: int, device: torch.device):
        self.event = event
        self.num_bytes = num_bytes
        self.device = device

    def wait_on_current_stream(self) -> None:
        """Make the current stream wait for the copy (no host sync)."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)

    def is_done(self) -> bool:
        """True once the copy has completed (polls, never blocks)."""
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        """Host wait until the copy has completed."""
        if self.event is not None:
            self.event.synchronize()


After = Union[torch.cuda.Event, TransferHandle, Sequence[Union[torch.cuda.Event, TransferHandle]], None]


def events_of(after: After) -> list[torch.cuda.Event]:
    """The events `after` names: handles (anything with `.event`) or events; Nones left out."""
    items = after if isinstance(after, (list, tuple)) else (after,)
    events = [getattr(item, "event", item) for item in items]
    return [event for event in events if event is not None]
