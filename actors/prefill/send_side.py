"""A prefill worker's sending side of KV streaming: its NIXL agent, its send manager and the
pump driving them, and what happened per request (``actors/prefill/worker.py`` owns one once
``enable_transfer`` ran; each TP rank of a TP instance owns its own, ``tp.py``)."""

from __future__ import annotations

import logging

from tetris.actors.transfer_pump import TransferPump
from tetris.config import TransferConfig
from tetris.transfer.states import ShardSent, TransferEvent, TransferFailed

__all__ = ["SendSide"]

log = logging.getLogger(__name__)


class SendSide:
    """The worker's sending side: agent, send manager, pump, and what happened per request.

    Every field is guarded by the pump's lock, so the pump thread's event handling and the
    actor's ``release``/``abort`` cannot interleave.
    """

    def __init__(self, instance: int, config: TransferConfig, name: str | None = None) -> None:
        from tetris.transfer.backends import make_agent
        from tetris.transfer.send_manager import SendManager

        self.config = config
        name = name or f"prefill-{instance}"   # a TP rank > 0 has its own agent (tp.py)
        self.agent = make_agent(name, backend=config.backend, config=config)
        self.mgr = SendManager(instance, self.agent, config)
        self.pump = TransferPump(self.mgr, name=name, on_events=self._on_events)
        self.sent: dict[str, int] = {}
        self.failed: dict[str, list[str]] = {}
        self.released: set[str] = set()   # shards still on the wire are forgotten once finished
        self.pump.start()

    def _on_events(self, events: list[TransferEvent]) -> None:
        with self.pump.locked() as mgr:
            for e in events:
                # Events of a request already aborted and forgotten here are stale.
                if not isinstance(e, (ShardSent, TransferFailed)) or not mgr.held(e.request_id):
                    continue
                if isinstance(e, ShardSent):
                    self.sent[e.request_id] = self.sent.get(e.request_id, 0) + 1
                else:
                    self.failed.setdefault(e.request_id, []).append(f"chunk {e.chunk_index}: {e.reason}")
                    log.warning("prefill-%d: KV stream of %s chunk %d failed: %s",
                                self.mgr.sender_id, e.request_id, e.chunk_index, e.reason)
                if e.request_id in self.released:
                    self._forget(e.request_id)

    def _forget(self, request_id: str) -> None:
        self.mgr.forget(request_id)
        if self.mgr.held(request_id):
            self.released.add(request_id)
        else:
            self.released.discard(request_id)
            self.sent.pop(request_id, None)
            self.failed.pop(request_id, None)

    def _transfers(self, request_id: str) -> list[str]:
        """The request's transfer and its elastic decode ranges' (``<id>@<start>``, as
        ``range_transfer_id`` names them: range_stream.py streams a range under its own id)."""
        ranged = f"{request_id}@"
        ranges = {k[0] for k in self.mgr.shards
                  if k[0].startswith(ranged) and k[0][len(ranged):].isdigit()}
        return [request_id, *sorted(ranges)]

    def release(self, request_id: str) -> None:
        with self.pump.locked():
            for tid in self._transfers(request_id):
                self._forget(tid)

    def abort(self, request_id: str) -> None:
        with self.pump.locked() as mgr:
            for tid in self._transfers(request_id):
                mgr.abort(tid, f"prefill of {request_id} aborted")
                self._forget(tid)

    def state(self, request_id: str) -> dict:
        with self.pump.locked() as mgr:
            keys = mgr.held(request_id)
            return {"shards": len(keys),
                    "unfinished": sum(not mgr.shards[k].state.finished for k in keys),
                    "sent": self.sent.get(request_id, 0),
                    "failed": list(self.failed.get(request_id, []))}

    def held(self) -> list[str]:
        with self.pump.locked() as mgr:
            return sorted({k[0] for k in mgr.shards})

    def close(self) -> None:
        self.pump.stop()
        self.mgr.close()
        self.agent.close()
