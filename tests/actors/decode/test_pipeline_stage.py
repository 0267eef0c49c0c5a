"""Served KunServe members in process: two engines, each a ``GroupMember`` joined by real
socket links (no Ray). A drop and a restore in the middle of generation give every token and
logprob of the single engine, with nothing recomputed; the capacity grows by exactly the
freed parameter bytes over the block bytes (KunServe invariant 2)."""

import socket
import threading
import types

import msgspec
import pytest
import torch
from tetris.actors.decode import stage_chain
from tetris.actors.decode.pipeline_stage import GroupMember, member_blocks
from tetris.transfer.traffic import TrafficClass

from tests.engine.engine_helpers import TINY
from tetris.engine.engine import LLMEngine
from tetris.engine.kv_cache import kv_bytes_per_block
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams
from tetris.scheduler.lookahead import Chunk
from tetris.scheduler.member_lookahead import MemberLookahead, decode_cost_model

CFG = msgspec.structs.replace(TINY, num_layers=4)
BLOCKS = 24
SHARPEN = 40.0
PROMPTS = [[5, 9, 13], list(range(20, 47)), [7] * 11, list(range(100, 119))]
MAX_TOKENS = [14, 10, 16, 12]


def _engine():
    model, _ = load_model(CFG)
    for layer in model.layers:   # attention far from uniform: a wrong key changes logits
        layer.self_attn.q_proj.weight.mul_(SHARPEN)
    return LLMEngine(model, num_blocks=BLOCKS, block_size=4, max_num_seqs=8)


def _params():
    return [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=2, temperature=0.0)
            for n in MAX_TOKENS]


def _collect(outputs, tokens):
    for out in outputs:
        tokens.setdefault(out.request_id, []).extend(
            (t, lp.logprob) for t, lp in zip(out.new_token_ids, out.new_logprobs, strict=True))


def _step_all(engines, tokens, steps=None):
    n = 0
    while any(e.has_unfinished() for e in engines) and (steps is None or n < steps):
        for e in engines:
            _collect(e.step(), tokens)
        n += 1


def _in_threads(fns):
    """Run each member's half at once (they exchange with each other); re-raise errors."""
    out, errors = [None] * len(fns), []

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def _members(engines, **kwargs):
    members = [GroupMember(e, j, "127.0.0.1", **kwargs) for j, e in enumerate(engines)]
    addrs = [m.address for m in members]
    _in_threads([lambda m=m: m.connect(addrs, 10.0) for m in members])
    return members


@pytest.mark.parametrize("ranges", [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]],
                         ids=["group-of-2", "group-of-3"])
def test_drop_and_restore_mid_generation_equal_the_single_engine(ranges):
    single = _engine()
    expected: dict = {}
    for i, (p, sp) in enumerate(zip(PROMPTS, _params(), strict=True)):
        single.add_request(f"r{i}", p, sp)
    _step_all([single], expected)

    n = len(ranges)
    engines = [_engine() for _ in range(n)]
    for i, (p, sp) in enumerate(zip(PROMPTS, _params(), strict=True)):
        engines[i % n].add_request(f"r{i}", p, sp)
    got: dict = {}
    _step_all(engines, got, steps=4)
    base = [e.stats().total_blocks for e in engines]
    g = min(member_blocks(e, *r) for e, r in zip(engines, ranges, strict=True))
    parts = [(j * g // n, (j + 1) * g // n) for j in range(n)]
    members = _members(engines)
    try:
        freed = _in_threads([lambda m=m: m.drop(ranges, g, parts) for m in members])
        block_bytes = kv_bytes_per_block(CFG.num_layers, 4, CFG.num_kv_heads,
                                         CFG.hidden_size // CFG.num_heads,
                                         engines[0].model.dtype)
        # invariant 2: each member's blocks = (KV bytes + freed bytes) // its layers' block
        # bytes; the group's are the smallest member's; for an even split that is the old
        # blocks plus the freed bytes over whole-model block bytes
        layer_block = block_bytes // CFG.num_layers
        per_member = [(BLOCKS * block_bytes + f) // ((t - s) * layer_block)
                      for f, (s, t) in zip(freed, ranges, strict=True)]
        assert g == min(per_member)
        if n == 2:
            assert g == sum(base) + sum(freed) // block_bytes
        assert sum(e.stats().total_blocks for e in engines) == g > sum(base)
        _step_all(engines, got, steps=5)
        assert all(m.runner.prefill_tokens == 0 for m in members)   # nothing recomputed
        assert all(m.stage_runs >= 5 for m in members)     # each served the other's steps
        _in_threads([lambda m=m: m.restore(BLOCKS) for m in members])
    finally:
        _close(members)
    assert [e.stats().total_blocks for e in engines] == base
    _step_all(engines, got)
    assert sorted(got) == sorted(expected)
    for rid, ref in expected.items():
        assert [t for t, _ in got[rid]] == [t for t, _ in ref], rid
        assert max(abs(a - b) for (_, a), (_, b) in zip(got[rid], ref, strict=True)) == 0.0, rid


def test_a_member_that_cannot_hold_its_requests_refuses_before_changing_anything():
    engines = [_engine(), _engine()]
    for i, p in enumerate(PROMPTS):
        engines[0].add_request(f"r{i}", p, _params()[i])
    _step_all(engines, {}, steps=2)
    members = _members(engines)
    try:
        with pytest.raises(ValueError, match="more than its 1 blocks"):
            members[0].drop([(0, 2), (2, 4)], 40, [(0, 1), (1, 40)])
        assert engines[0].cache is not None and len(engines[0].model.layers[3].state_dict())
    finally:
        _close(members)


# -- the chain of hops (stage_chain.py) ------------------------------------------------------
RANGES_3 = [(0, 1), (1, 3), (3, 4)]


def _dropped(ranges, requests_per_member, got=None, **kwargs):
    """Engines with requests spread over the members (all on one: ``requests_per_member``
    names it), stepped twice, dropped into a group."""
    n = len(ranges)
    engines = [_engine() for _ in range(n)]
    for i, (p, sp) in enumerate(zip(PROMPTS, _params(), strict=True)):
        if isinstance(requests_per_member, int):
            engines[requests_per_member].add_request(f"r{i}", p, sp)
        elif requests_per_member[i % n]:
            engines[i % n].add_request(f"r{i}", p, sp)
    _step_all(engines, {} if got is None else got, steps=2)
    g = min(member_blocks(e, *r) for e, r in zip(engines, ranges, strict=True))
    members = _members(engines, **kwargs)
    _in_threads([lambda m=m: m.drop(ranges, g, [(j * g // n, (j + 1) * g // n)
                                                for j in range(n)]) for m in members])
    return engines, members


def _record_hops(members):
    """Every activation message sent, as (sender, receiver, owner, step, micro-batch)."""
    sent = []
    for m in members:
        def send(peer, msg, cls, m=m, inner=m.links.send):
            if cls == TrafficClass.ACTIVATION and msg["kind"] in ("chain", "result"):
                owner = msg["owner"] if msg["kind"] == "chain" else peer
                sent.append((m.member, peer, owner, msg["step"], msg["mb"]))
            inner(peer, msg, cls)
        m.links.send = send
    return sent


@pytest.mark.parametrize("ranges,routes", [
    ([(0, 2), (2, 4)], [[0, 1, 0], [1, 0, 1]]),
    (RANGES_3, [[0, 1, 2, 0], [1, 0, 1, 2, 1], [2, 0, 1, 2]]),
], ids=["group-of-2", "group-of-3"])
def test_a_step_passes_the_stages_as_a_chain(ranges, routes):
    """Group of 3: the first and last members' steps take 3 hops, the middle one's 4 (it
    sends its batch to layer 0's member and gets it back when the chain passes it, then from
    the last); a star (a round trip per other member: 0->1->0->2->0) takes 4 for each. Group
    of 2: 2 hops, as before."""
    engines, members = _dropped(ranges, [1] * len(ranges))
    try:
        sent = _record_hops(members)
        for e in engines:   # one step each, in turn: every hop of a step is its own
            e.step()
    finally:
        _close(members)
    for owner, route in enumerate(routes):
        mine = [(a, b) for a, b, o, _, _ in sent if o == owner]
        assert [mine[0][0]] + [b for _, b in mine] == route, (owner, mine)
    assert sum(len(r) - 1 for r in routes) < 2 * (len(ranges) - 1) * len(ranges) or \
        len(ranges) == 2   # fewer than the star's hops
    assert [m.stage_runs for m in members] == [len(ranges) - 1] * len(ranges)


def test_a_dead_middle_member_fails_the_owners_step_at_once():
    """Member 1 dies (its sockets close) while member 0's batch waits in its layers: the
    owner's step fails long before the step timeout, naming the lost member."""
    engines, members = _dropped(RANGES_3, [1, 1, 1], step_timeout_s=60.0)
    entered, release = threading.Event(), threading.Event()
    local_run = members[1].stage.run

    def stuck(*args):
        entered.set()
        release.wait(30)
        return local_run(*args)

    members[1].stage.run = stuck
    killer = threading.Thread(target=lambda: (entered.wait(30), _kill(members[1])))
    killer.start()
    try:
        with pytest.raises(RuntimeError, match="member 1") as err:
            engines[0].step()
        assert "within" not in str(err.value)       # the break, not the timeout
        with pytest.raises(RuntimeError, match="member 1"):
            engines[2].step()                        # another member's step fails too
    finally:
        release.set()
        killer.join()
        _close(members)


def test_a_hung_middle_member_fails_the_owners_step_within_the_timeout():
    """Member 1 hangs with its sockets open: member 0's step fails after step_timeout_s."""
    engines, members = _dropped(RANGES_3, [1, 1, 1], step_timeout_s=1.0)
    release = threading.Event()
    local_run = members[1].stage.run
    members[1].stage.run = lambda *args: (release.wait(30), local_run(*args))[1]
    try:
        with pytest.raises(RuntimeError, match=r"got 0 of 1 micro-batches back within 1.0 s"):
            engines[0].step()
    finally:
        release.set()
        _close(members)


def _close(members):
    """The group's end: every member knows it is closing before any link goes down."""
    for m in members:
        m.closing = True
    for m in members:
        m.close()


def _kill(member):
    """A member's death as its peers see it: its sockets close under them."""
    member.closing = True
    for sock in list(member.links._socks.values()):
        sock.shutdown(socket.SHUT_RDWR)


@pytest.mark.parametrize("ranges,owner,count,k,overlap", [
    ([(0, 2), (2, 4)], 0, None, 2, True), (RANGES_3, 1, 3, 3, True),
    ([(0, 2), (2, 4)], 1, None, 2, False)],
    ids=["group-of-2-by-load", "group-of-3-middle-fixed-3", "group-of-2-one-at-a-time"])
def test_lookahead_micro_batches_equal_the_single_engine(ranges, owner, count, k, overlap):
    """Every request on one member, the others idle: that member cuts each decode step into
    k cost-balanced micro-batches (by the group's load: ceil(g * own / own) = g; or a fixed
    3), all in the chain at once, each taking the member's route; every token and logprob
    equals the single engine's."""
    single = _engine()
    expected: dict = {}
    for i, (p, sp) in enumerate(zip(PROMPTS, _params(), strict=True)):
        single.add_request(f"r{i}", p, sp)
    _step_all([single], expected)
    cost = decode_cost_model(CFG.hidden_size, 30_000, overhead_seqs=0.5)
    got: dict = {}
    engines, members = _dropped(ranges, owner, got,
                                lookahead=MemberLookahead(cost, min_tokens=1, count=count))
    members[owner].runner.overlap = overlap
    try:
        sent = _record_hops(members)
        _step_all(engines, got)
    finally:
        _close(members)
    runner = members[owner].runner
    assert runner.prefill_tokens == 0
    steps = {(st, mb) for _, _, o, st, mb in sent if o == owner}
    per_step = [sum(1 for st, _ in steps if st == s) for s in sorted({st for st, _ in steps})]
    assert per_step[0] == max(per_step) == k           # while enough requests run
    assert per_step == sorted(per_step, reverse=True) and per_step[-1] == 1  # one left: 1
    assert runner.micro_batches == sum(per_step)
    if not overlap:   # each micro-batch's whole route before the next one starts
        for st in {st for _, _, o, st, _ in sent if o == owner}:
            order = [mb for _, _, o, s, mb in sent if o == owner and s == st]
            assert order == sorted(order)
    hops = len(ranges) + (0 < owner < len(ranges) - 1)
    assert len([x for x in sent if x[2] == owner]) == hops * len(steps)
    assert sorted(got) == sorted(expected)
    for rid, ref in expected.items():
        assert got[rid] == ref, rid      # tokens and logprobs, bit for bit


def test_a_peers_load_counts_while_its_chains_keep_coming(monkeypatch):
    """The load a member reads from the chains passing through it: a peer's step cost (its
    micro-batches' Eq. (2) summed, one load), kept while the peer's chains come at most twice
    its own interval apart, dropped once it fell silent."""
    cost = decode_cost_model(CFG.hidden_size, 30_000, overhead_seqs=0.5)
    _, members = _dropped([(0, 2), (2, 4)], [1, 1], lookahead=MemberLookahead(cost))
    _close(members)
    runner, now = members[0].runner, [100.0]
    monkeypatch.setattr(stage_chain.time, "monotonic", lambda: now[0])

    def batch(*contexts):
        return types.SimpleNamespace(context_lens=torch.tensor(contexts))

    def chunks(*contexts):
        return [Chunk("", c, 1) for c in contexts]

    runner._note_load(1, 7, batch(10, 20), True)
    runner._note_load(1, 7, batch(30), True)             # the same step's next micro-batch
    assert runner._peers_cost() == [pytest.approx(cost.batch(chunks(10, 20, 30)))]
    now[0] = 101.0
    runner._note_load(1, 8, batch(11), True)             # its next step, 1 s later
    now[0] = 102.9
    assert runner._peers_cost() == [pytest.approx(cost.batch(chunks(11)))]
    now[0] = 103.1                                      # silent for over twice its interval
    assert runner._peers_cost() == []
