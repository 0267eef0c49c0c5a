"""The transfer pump's routing, locking and idle behaviour, with a fake manager (no Ray)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tetris.actors.transfer_pump import TransferPump
from tetris.transfer.messages import Abort, Envelope
from tetris.transfer.states import TransferFailed


class _Remote:
    def __init__(self) -> None:
        self.calls: list[list] = []

    def remote(self, msgs) -> None:
        self.calls.append(list(msgs))


class _Peer:
    def __init__(self) -> None:
        self.deliver_transfer = _Remote()


class _Manager:
    def __init__(self) -> None:
        self.delivered: list = []
        self.outbox: list[Envelope] = []
        self.shards: dict = {}
        self.lost: list[int] = []

    def deliver(self, msg, now) -> None:
        self.delivered.append(msg)

    def poll(self, now):
        return [TransferFailed(request_id=m.request_id, reason=m.reason) for m in self.delivered
                if isinstance(m, Abort)]

    def drain_outbox(self):
        out, self.outbox = self.outbox, []
        return out

    def peer_lost(self, peer_id, now) -> None:
        self.lost.append(peer_id)


def _abort(rid: str) -> Abort:
    return Abort(request_id=rid, reason="x", origin="receiver", origin_id=0)


def test_round_delivers_inbox_routes_outbox_per_peer_and_reports_events():
    mgr, events = _Manager(), []
    pump = TransferPump(mgr, name="t", on_events=events.extend)
    a, b = _Peer(), _Peer()
    pump.connect({1: a, 2: b})
    pump.deliver([_abort("r1")])
    mgr.outbox = [Envelope("receiver", 2, _abort("x")), Envelope("receiver", 1, _abort("y")),
                  Envelope("receiver", 2, _abort("z")), Envelope("receiver", 9, _abort("w"))]
    out = pump.pump_once()
    assert [m.request_id for m in mgr.delivered] == ["r1"]
    assert [[m.request_id for m in c] for c in b.deliver_transfer.calls] == [["x", "z"]]
    assert [[m.request_id for m in c] for c in a.deliver_transfer.calls] == [["y"]]
    assert pump.dropped == 1                      # no peer 9: dropped and counted
    assert [e.request_id for e in out] == [e.request_id for e in events] == ["r1"]


def test_a_new_actor_under_a_known_id_gives_up_the_old_ones_work():
    mgr = _Manager()
    pump = TransferPump(mgr, name="t")
    a, b, c = _Peer(), _Peer(), _Peer()
    assert pump.connect({1: a, 2: b}) == [] and mgr.lost == []     # first wiring: nothing lost
    assert pump.connect({1: a}) == [] and mgr.lost == []           # the same actor again
    assert pump.connect({2: c, 3: _Peer()}) == [2] and mgr.lost == [2]   # 2 replaced, 3 is new
    mgr.outbox = [Envelope("receiver", 2, _abort("after"))]
    pump.pump_once()
    assert b.deliver_transfer.calls == [] and len(c.deliver_transfer.calls) == 1   # routed to the new one
    # None: dead and not yet replaced: given up at once and its messages dropped; None again
    # changes nothing, and the successor replaces it like any other actor
    assert pump.connect({1: None}) == [1] and mgr.lost == [2, 1]
    mgr.outbox = [Envelope("receiver", 1, _abort("to the dead"))]
    pump.pump_once()
    assert a.deliver_transfer.calls == [] and pump.dropped == 1
    assert pump.connect({1: None}) == [] and pump.connect({1: a}) == [1] and mgr.lost == [2, 1, 1]


def test_finished_shards_do_not_keep_the_pump_busy():
    mgr = _Manager()
    pump = TransferPump(mgr, name="t")
    assert not pump._busy()
    mgr.shards = {("r", 0, 1): SimpleNamespace(state=SimpleNamespace(finished=True))}
    assert not pump._busy()
    mgr.shards[("r", 1, 1)] = SimpleNamespace(state=SimpleNamespace(finished=False))
    assert pump._busy()


def test_thread_runs_rounds_and_wakes_on_delivery():
    mgr = _Manager()
    pump = TransferPump(mgr, name="t", idle_interval_s=5.0).start()
    try:
        time.sleep(0.05)
        t0 = time.monotonic()
        pump.deliver([_abort("r2")])
        while not mgr.delivered and time.monotonic() - t0 < 2.0:
            time.sleep(0.005)
        assert [m.request_id for m in mgr.delivered] == ["r2"]
        assert time.monotonic() - t0 < 2.0        # woken, not after the 5 s idle nap
        with pump.locked() as m:
            assert m is mgr
    finally:
        pump.stop()
    assert not pump._thread.is_alive()


class _IdleManager(_Manager):
    """Holds nothing (``idle``) and counts its rounds."""

    def __init__(self) -> None:
        super().__init__()
        self.polls = 0

    def poll(self, now):
        self.polls += 1
        return super().poll(now)

    def idle(self) -> bool:
        return not self.delivered


def _thread_cpu_s(thread) -> float:
    import psutil

    for t in psutil.Process().threads():
        if t.id == thread.native_id:
            return t.user_time + t.system_time
    raise AssertionError("the pump thread is gone")


def test_an_idle_pump_sleeps_until_woken_and_wakes_at_once():
    # An idle server: every prefill worker's and decode rank's pump used to run a round every
    # idle_interval_s (50 ms) with nothing to do. Now a pump whose manager holds nothing blocks
    # until a message or an owner call wakes it, and then runs the round at once.
    mgr = _IdleManager()
    pump = TransferPump(mgr, name="t", interval_s=0.001, idle_interval_s=0.001).start()
    try:
        time.sleep(0.1)
        polls, cpu0, t0 = mgr.polls, _thread_cpu_s(pump._thread), time.monotonic()
        time.sleep(1.5)
        cpu = (_thread_cpu_s(pump._thread) - cpu0) / (time.monotonic() - t0)
        assert mgr.polls == polls <= 1            # not a single round while idle
        assert cpu < 0.01, f"an idle pump used {cpu:.1%} of a core"
        waits = []
        for i in range(5):
            t0 = time.monotonic()
            pump.deliver([_abort(f"r{i}")])
            while len(mgr.delivered) <= i:
                assert time.monotonic() - t0 < 1.0, "the pump did not wake"
                time.sleep(0.0002)
            waits.append(time.monotonic() - t0)
            with pump.locked() as m:
                m.delivered = m.delivered[:i + 1]
        assert sorted(waits)[2] < 0.02, waits     # woken at once (median; no nap to wait out)
        # an owner call wakes it too: a manager with work polls every interval_s again
        before = mgr.polls
        with pump.locked() as m:
            m.delivered.append(_abort("held"))
        time.sleep(0.2)
        assert mgr.polls - before >= 10
    finally:
        pump.stop()
    assert not pump._thread.is_alive()


def test_a_manager_without_idle_keeps_the_nap():
    # Only a manager that says it is idle is trusted to be woken for all its work.
    mgr = _Manager()
    pump = TransferPump(mgr, name="t")
    assert not pump._busy() and not pump._idle() and pump._nap() == pump.idle_interval_s
    mgr2 = _IdleManager()
    assert TransferPump(mgr2, name="t2")._nap() is None


def test_real_managers_ask_for_polling_only_while_a_piece_can_land():
    import sys

    import torch

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "transfer"))
    from transfer_helpers import HKV, LAYERS, D, Cluster, source_kv

    from tetris.config import TransferConfig

    cfg = TransferConfig(num_backends=1, pool_size=1, backend_buffer_bytes=1024, backend_slots=4,
                         send_buffer_bytes=1024, bulk_chunk_bytes=1024)
    c = Cluster(1, cfg)
    sender, receiver = c.senders[0], c.receiver
    assert sender.idle() and receiver.idle()       # nothing held: the pumps sleep until woken
    assert TransferPump(sender, name="s")._nap() is None
    sender.add_shard(request_id="r", chunk_index=0, receiver_id=0, prompt_tokens=8, chunk=(0, 8),
                     ranges=[(0, 8)], num_layers=LAYERS, kv_heads=HKV, head_dim=D,
                     dtype=torch.float32, now=c.now)
    c.step()
    # a shard waiting for its first computed layer: nothing can complete without a message
    assert not sender.needs_polling() and not receiver.needs_polling()
    assert not TransferPump(sender, name="s")._busy()
    kv = source_kv(8, seed=1)
    sender.layer_ready("r", 0, 0, kv[0])
    c.route()
    receiver.poll(c.now)           # grants the computed pieces
    assert receiver.needs_polling() and TransferPump(receiver, name="r")._busy()
    c.route()
    sender.poll(c.now)             # the first piece goes on the wire
    # (the in-process backend completes writes at once; the sender still polls to see it)
    assert sender.needs_polling()
    for _ in range(20):
        c.step()
    assert not receiver.requests["r"].coverage[1].any()   # layer 1 is not computed yet
    assert not sender.needs_polling() and not receiver.needs_polling()
    # waiting on compute: not idle (the timeouts run), so the pumps keep their nap
    assert not sender.idle() and not receiver.idle()
    assert TransferPump(receiver, name="r")._nap() == TransferPump(receiver, name="r").idle_interval_s
    for layer in range(1, LAYERS):
        sender.layer_ready("r", 0, layer, kv[layer])
    for _ in range(200):
        c.step()
        if sender.idle() and receiver.idle():
            break
    assert sender.idle() and "r" not in receiver.requests   # all of it landed: idle again


def test_the_thread_survives_a_failing_busy_check():
    # The busy check once raised outside the round's handler (a dict changed size while it was
    # read) and killed the thread: that prefill worker's KV never moved again.
    class Flaky(_Manager):
        calls = 0

        def needs_polling(self):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("dictionary changed size during iteration")
            return False

    mgr = Flaky()
    pump = TransferPump(mgr, name="t", idle_interval_s=0.01).start()
    try:
        deadline = time.monotonic() + 2.0
        while Flaky.calls < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pump._thread.is_alive() and Flaky.calls >= 3
        pump.deliver([_abort("r3")])
        while not mgr.delivered and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [m.request_id for m in mgr.delivered] == ["r3"]
    finally:
        pump.stop()
