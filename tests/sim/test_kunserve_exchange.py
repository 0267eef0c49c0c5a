"""A drop's KV exchange in the SIMULATION: the old unit's requests queue on its links (the
paper's 1-2 s stall), and a request still in prefill exchanges nothing."""

import msgspec
import pytest

from tetris.control.drop_plan import Group, split_layers
from tetris.sim.kunserve import KunRequest, KunServeSim
from tetris.sim.kunserve_exchange import ExchangeQueue
from tetris.sim.kunserve_workload import load_profile, profile_path

MEM, PROF = load_profile(profile_path("qwen2.5-14b-tp1"))


def test_the_queue_adds_each_requests_bytes_over_the_senders_links():
    q = ExchangeQueue(10.0, 2, 25e9)
    assert q.send(25e9) == pytest.approx(10.5)
    assert q.send(50e9) == pytest.approx(11.5)


def test_a_drops_exchange_stalls_each_request_until_its_turn_on_the_link():
    prof = msgspec.structs.replace(PROF, instances=2)
    reqs = [KunRequest(i, 0.0, 1000 + 100 * i, 50) for i in range(6)]
    sim = KunServeSim(reqs, MEM, prof, "kunserve")
    a, b = sim.units
    for r in reqs[:5]:          # decoding on instance 0
        r.generated, r.blocks, r.unit, r.home = 3, sim._blocks(r.tokens + 1), a, 0
        a.running.append(r)
        a.used += r.blocks
    late = reqs[5]              # still in prefill on instance 1 until t = 9
    late.blocks, late.unit, late.home, late.stalled_until, late.prefill_end = 80, b, 1, 9.0, 9.0
    b.running.append(late)
    b.used += late.blocks
    sim.control.groups = [Group((0, 1), split_layers(48, 2))]
    sim._regroup(1.0, [(0, 1)])
    half = MEM.block_bytes / 2            # g = 2: half of each block crosses
    t = 1.0
    for r in reqs[:5]:
        t += r.blocks * half / PROF.link_bytes_per_s
        assert r.stalled_until == pytest.approx(t)
    own = reqs[4].blocks * half / PROF.link_bytes_per_s
    assert reqs[4].stalled_until - 1.0 > 4 * own     # its turn, not its own bytes alone
    assert late.stalled_until == 9.0      # its prefill's KV streams to the group
    assert sim.exchange_bytes == pytest.approx(sum(r.blocks for r in reqs[:5]) * half)
