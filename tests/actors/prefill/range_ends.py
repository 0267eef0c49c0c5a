"""What the tests of elastic decode's hand-off from the prefill side share: each sender's and
receiver's transfer side on a pump in this process, wired all to all, and the wait for every
KV range's transfer to end at its holder."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from tetris.actors.transfer_pump import TransferPump
from tetris.transfer.send_manager import SendManager
from tetris.transfer.states import RequestReady, ShardSent, TransferFailed


class End:
    """A sender's or receiver's transfer side on a pump; ``deliver_transfer`` is its inbox."""

    def __init__(self, name: str, manager, agent) -> None:
        self.agent, self.events, self._lock = agent, [], threading.Lock()
        self.pump = TransferPump(manager, name=name, on_events=self._record).start()

    def _record(self, events) -> None:
        with self._lock:
            self.events.extend(events)
        done = [e.request_id for e in events if isinstance(e, (ShardSent, TransferFailed))]
        if done and isinstance(self.pump.manager, SendManager):
            with self.pump.locked() as mgr:
                for rid in done:
                    mgr.forget(rid)

    @property
    def deliver_handle(self):
        """What a pump sends to: ``handle.deliver_transfer.remote(msgs)``, a direct call here."""
        return SimpleNamespace(deliver_transfer=SimpleNamespace(remote=self.pump.deliver))


def wire(senders: list[End], receivers: list[End]) -> None:
    """Every sender knows every receiver's agent, and each pump sends to the other side's."""
    for s in senders:
        for recv in receivers:
            s.agent.add_peer(recv.agent.info())
        s.pump.connect({r: recv.deliver_handle for r, recv in enumerate(receivers)})
    for recv in receivers:
        recv.pump.connect({i: s.deliver_handle for i, s in enumerate(senders)})


def close(ends: list[End]) -> None:
    for e in ends:
        e.pump.stop()
        e.agent.close()


def wait_ready(receivers: list[End], ranges, deadline_s: float) -> dict:
    """Each range's first ``RequestReady`` or ``TransferFailed`` at its holder, by transfer
    id; the ranges still open after ``deadline_s`` are missing."""
    outcomes, deadline = {}, time.monotonic() + deadline_s
    while len(outcomes) < len(ranges) and time.monotonic() < deadline:
        for rng in ranges:
            recv = receivers[rng.receivers[0]]
            with recv._lock:
                got = [e for e in recv.events if isinstance(e, (RequestReady, TransferFailed))
                       and e.request_id == rng.transfer_id]
            if got:
                outcomes[rng.transfer_id] = got[0]
        time.sleep(0.01)
    return outcomes
