"""Prefix caching in the whole served system over HTTP (Ray Serve, the SP pool, KV streaming to
a TP-2 decode instance): requests sharing prefixes are planned from the cache, and their greedy
outputs equal the single engine's (which computes every prompt whole); once the cache is
cleared nothing is held.

One app for the module; the deployment is test_app_e2e's with ``[prefix_cache] enabled`` and an
index of 48 blocks (768 tokens): the first test's requests fit (46 blocks), the second's make it
evict. ``placement = "move"``: a hit's prefix KV is moved to a first group without its holders
wherever the planner can (its source's prefill done, instances free of the holders), else the
holders' group is extended (actors/prefill/prefix_move.py; the last test checks a move).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import msgspec
import pytest
from cluster_configs import MODEL, write_tiny_cluster
from exactness import TOP, assert_api_logprobs, engine_runs

from tetris.config import load_deployment
from tetris.engine.engine import LLMEngine
from tetris.sampling_params import SamplingParams
from tetris.serve.logprobs_format import TokenText

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


def _write_deployment(tmp) -> str:
    return write_tiny_cluster(tmp, """
[prefix_cache]
enabled = true
block_tokens = 16
capacity_blocks = 48
decode_runs = 4
placement = "move"
""")


@pytest.fixture(scope="module")
def app(serve_http, tmp_path_factory):
    from ray import serve

    from tetris.serve.app import APP_NAME, build_app

    cfg = load_deployment(_write_deployment(tmp_path_factory.mktemp("prefix")))
    serve.run(build_app(cfg, max_pending=8), name=APP_NAME, route_prefix="/")
    yield cfg, serve_http
    serve.delete(APP_NAME)


def _tokens(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 11) % 500 + 3 for i in range(n)]


def _held_idle(base) -> tuple[bool, dict]:
    held = httpx.get(f"{base}/admin/held", timeout=60).json()
    d = held["dispatcher"]
    idle = (d["inflight"] == d["queue_bookings"] == d["virtual_usage"] == d["prefix_refs"] == 0
            and d["cleanups"] == 0 and not any(held["prefill"].values())
            and all(rank["empty"] for inst in held["decode"] for rank in inst["ranks"]))
    return idle, held


def test_shared_prefixes_are_served_from_the_cache_token_for_token(app):
    cfg, base = app
    engine = LLMEngine.from_deployment(cfg, num_blocks=256)
    doc = _tokens(600, 1)                       # 37 whole blocks and 8 tokens
    q1 = doc + _tokens(40, 2)
    q2 = doc + _tokens(60, 3)                   # shares 600 tokens: 592 can hit
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = {k: engine.generate([p], params)[0] for k, p in (("q1", q1), ("q2", q2))}
    turn2 = q1 + list(ref["q1"].token_ids) + _tokens(30, 4)
    ref["turn2"] = engine.generate([turn2], params)[0]
    prompts = {"q1": q1, "q2": q2, "again": q1, "turn2": turn2}
    ref["again"] = ref["q1"]
    # and every token's logprobs: a prefix read wrong can leave the greedy tokens as they were
    want_lp = dict(zip(prompts, engine_runs(engine, list(prompts.values()), msgspec.structs.replace(
        params, logprobs=TOP))))

    async def run():
        out, usage, logprobs = {}, {}, {}
        async with httpx.AsyncClient(timeout=120) as c:
            for name, prompt in prompts.items():   # one after another: each finds the last
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                        "ignore_eos": True, "logprobs": TOP}
                if name == "again":   # streamed: the usage comes in the last event
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                r = await c.post(f"{base}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                if name == "again":
                    events = [json.loads(line[6:]) for line in r.text.splitlines()
                              if line.startswith("data: {")]
                    out[name] = "".join(e["choices"][0]["text"] for e in events if e["choices"])
                    usage[name] = events[-1]["usage"]
                    logprobs[name] = {key: [x for e in events if e["choices"]
                                            for x in e["choices"][0]["logprobs"][key]]
                                      for key in ("tokens", "token_logprobs", "top_logprobs")}
                else:
                    out[name] = r.json()["choices"][0]["text"]
                    usage[name] = r.json()["usage"]
                    logprobs[name] = r.json()["choices"][0]["logprobs"]
            plans = (await c.get(f"{base}/admin/plans")).json()
            cache = (await c.get(f"{base}/admin/prefix_cache")).json()
        return out, usage, logprobs, plans, cache

    out, usage, logprobs, plans, cache = asyncio.run(run())
    assert out == {k: ref[k].text for k in prompts}
    for name, want in want_lp.items():
        assert_api_logprobs(logprobs[name], want, TokenText(engine.tokenizer), name)
    details = {k: u.get("prompt_tokens_details") for k, u in usage.items()}
    assert details == {"q1": None, "q2": {"cached_tokens": 592},
                       "again": {"cached_tokens": len(q1) - 1},
                       "turn2": {"cached_tokens": 640}}
    assert usage["turn2"]["prompt_tokens"] == len(turn2)
    cached = [p["cached_tokens"] for p in plans[-4:]]
    # q1 cold; q2 hits the document's whole blocks; q1 again hits all but its last token;
    # the second turn hits q1's 640 tokens (its answer's tokens were never prefilled).
    assert cached == [0, 592, len(q1) - 1, 640], cached
    # each hit reads a prefix sharded over several prefill instances (q1 ran on SP > 1)
    assert all(len(p["cached_instances"]) >= 2 for p in plans[-3:]), plans[-3:]
    assert cache["enabled"] and cache["hits"] == 3 and cache["queries"] == 4
    # The decode side: q2, q1 again and the second turn were routed to the instance keeping
    # q1's run (prompt and answer but its last token), which read their cached prefix from
    # it; the prefill pool streamed only what it computed.
    assert (cache["decode_reuses"], cache["decode_reused_tokens"]) == (3, 592 + 639 + 640), cache
    # ... and shares the kept run's whole blocks (engine/kept_kv.py): the instance holds the
    # four kept runs (prompt and 11 of 12 outputs each) in the blocks none of them shares
    bs = cfg.decode.block_size

    def blocks(n):
        return -(-n // bs)

    own = {"q1": blocks(len(q1) + 11), "q2": blocks(len(q2) + 11) - 592 // bs,
           "again": blocks(len(q1) + 11) - 639 // bs, "turn2": blocks(len(turn2) + 11) - 640 // bs}
    held = _wait_idle(base, _nothing_in_flight)
    for rank in held["decode"][0]["ranks"]:   # every TP rank shares alike
        assert rank["total_blocks"] - rank["free_blocks"] == sum(own.values()), (own, rank)
    metrics = httpx.get(f"{base}/metrics", timeout=60).text
    assert "tetris:prefix_cache_hits_total" in metrics
    cleared = httpx.delete(f"{base}/admin/prefix_cache", timeout=60).json()
    assert cleared["blocks"] == 0 and cleared["sources"] == 0
    deadline = time.monotonic() + 20
    idle, held = _held_idle(base)
    while not idle and time.monotonic() < deadline:   # cleanups finish asynchronously
        time.sleep(0.2)
        idle, held = _held_idle(base)
    assert idle, json.dumps(held, indent=1)


async def _complete(c, base, prompt, max_tokens=12) -> dict:
    r = await c.post(f"{base}/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


async def _abort_after_first(c, base, prompt) -> None:
    """Stream a long completion and hang up after its first event: the run is aborted
    wherever it is then (planned, in prefill or decoding)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with c.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                break


def _wait_idle(base, want) -> dict:
    """Poll ``/admin/held`` until ``want(held)`` (cleanups finish asynchronously), 30 s at most."""
    deadline = time.monotonic() + 30
    held = httpx.get(f"{base}/admin/held", timeout=60).json()
    while not want(held) and time.monotonic() < deadline:
        time.sleep(0.2)
        held = httpx.get(f"{base}/admin/held", timeout=60).json()
    return held


def _nothing_in_flight(held) -> bool:
    """Idle, but for what the prefix cache keeps (prefill runs, decode runs' KV)."""
    d = held["dispatcher"]
    return (d["inflight"] == d["queue_bookings"] == d["virtual_usage"] == d["prefix_refs"] == 0
            and d["cleanups"] == 0
            and all(rank["engine_requests"] == 0 and not rank["receiving"]
                    and not rank["backends_held"] for inst in held["decode"]
                    for rank in inst["ranks"]))


def test_partial_eviction_interleaving_and_aborts_stay_exact_and_leak_nothing(app):
    cfg, base = app
    httpx.delete(f"{base}/admin/prefix_cache", timeout=60)   # the first test's blocks
    engine = LLMEngine.from_deployment(cfg, num_blocks=256)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    doc_a, doc_c, doc_d = _tokens(560, 5), _tokens(320, 9), _tokens(320, 10)
    # A's first question indexes 37 blocks, B's 22 more evict A's 11 deepest: A's second
    # question hits the 26 left (416 tokens), reading a prefix of a source that holds more.
    serial = {"a1": doc_a + _tokens(40, 6), "b": _tokens(352, 8), "a2": doc_a + _tokens(24, 7)}
    # Then two documents' questions at once, 56 new blocks into a full index: it evicts while
    # they run, some of them running from a prefix still being prefilled; two hang up early.
    together = {"c1": doc_c + _tokens(40, 11), "d1": doc_d + _tokens(40, 13),
                "c2": doc_c + _tokens(56, 12), "d2": doc_d + _tokens(56, 14),
                "c3": doc_c + _tokens(72, 16), "d3": doc_d + _tokens(24, 17)}
    aborted = [doc_c + _tokens(48, 15), doc_d + _tokens(48, 18)]
    prompts = serial | together
    ref = {k: engine.generate([p], params)[0].text for k, p in prompts.items()}

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            out = {k: await _complete(c, base, serial[k]) for k in serial}
            evictions = (await c.get(f"{base}/admin/prefix_cache")).json()["evictions"]
            got = await asyncio.gather(*(_complete(c, base, p) for p in together.values()),
                                       *(_abort_after_first(c, base, p) for p in aborted))
            out |= dict(zip(together, got))
            return out, evictions, (await c.get(f"{base}/admin/prefix_cache")).json()

    out, evictions_serial, cache = asyncio.run(run())
    assert {k: r["choices"][0]["text"] for k, r in out.items()} == ref
    cached = {k: (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
              for k, r in out.items()}
    assert (cached["a1"], cached["b"], cached["a2"]) == (0, 0, 416), cached
    assert evictions_serial == 11 + 10   # b evicts 11 of a1's blocks, a2's 10 new evict b's
    assert cache["evictions"] > evictions_serial and cache["blocks"] <= 48, cache
    assert any(cached[k] for k in together), cached   # each document's later questions hit
    # at most the document's 20 blocks (its questions differ from there), fewer if evicted
    assert all(cached[k] in range(0, 321, 16) for k in together), cached
    # Idle: every cached block referenced or free, and the prefill pool holds exactly the
    # runs the index keeps (nothing an eviction, an abort or a failure let go is left).
    held = _wait_idle(base, _nothing_in_flight)
    assert _nothing_in_flight(held), json.dumps(held, indent=1)
    cache = httpx.get(f"{base}/admin/prefix_cache", timeout=60).json()
    assert cache["consistent"] is True and cache["referenced_blocks"] == 0, cache
    on_pool = {run for runs in held["prefill"].values() for run in runs}
    assert on_pool == set(cache["source_runs"]) and on_pool, (on_pool, cache)
    # every decode rank keeps exactly the runs the dispatcher records, no aborted one
    kept = {str(i): sorted(inst["ranks"][0]["kept"]) for i, inst in enumerate(held["decode"])}
    assert all(rank["kept"] == kept[str(i)] for i, inst in enumerate(held["decode"])
               for rank in inst["ranks"])
    assert {i: r for i, r in kept.items() if r} == cache["decode_kept"], (kept, cache)
    cleared = httpx.delete(f"{base}/admin/prefix_cache", timeout=60).json()
    assert cleared["blocks"] == cleared["sources"] == 0 and cleared["consistent"] is True
    idle, held = _held_idle(base)
    assert idle, json.dumps(held, indent=1)


def test_a_prefix_moved_to_a_group_without_its_holders_is_served_exactly(app):
    """A document's first question hangs up after its first token (prefilled and indexed, not
    kept on decode); the second is planned from its prefix moved to instances free of the
    holders, streamed to decode from there; the third reads it again, moved from the second's
    instances, with the decode instance copying the kept second run. Tokens and logprobs equal
    the single engine's; nothing is held once the cache is cleared."""
    cfg, base = app
    httpx.delete(f"{base}/admin/prefix_cache", timeout=60)   # the earlier tests' blocks
    engine = LLMEngine.from_deployment(cfg, num_blocks=256)
    # 10 whole blocks: the first question runs on two instances (a longer one takes all four,
    # and a move needs instances free of the holders)
    doc = _tokens(160, 21)
    prompts = {"q2": doc + _tokens(40, 23), "q3": doc + _tokens(56, 24)}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=TOP)
    want = dict(zip(prompts, engine_runs(engine, list(prompts.values()), params)))
    ref = {k: engine.generate([p], msgspec.structs.replace(params, logprobs=None))[0].text
           for k, p in prompts.items()}

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            await _abort_after_first(c, base, doc + _tokens(24, 22))
            before = (await c.get(f"{base}/admin/prefix_cache")).json()
            out = {}
            for name, prompt in prompts.items():
                r = await c.post(f"{base}/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True, "logprobs": TOP})
                assert r.status_code == 200, r.text
                out[name] = r.json()
            plans = (await c.get(f"{base}/admin/plans")).json()
            return out, plans, before, (await c.get(f"{base}/admin/prefix_cache")).json()

    out, plans, before, cache = asyncio.run(run())
    assert {k: r["choices"][0]["text"] for k, r in out.items()} == ref
    for name, r in out.items():
        assert_api_logprobs(r["choices"][0]["logprobs"], want[name], TokenText(engine.tokenizer),
                            name)
    assert {k: r["usage"]["prompt_tokens_details"] for k, r in out.items()} == {
        "q2": {"cached_tokens": 160}, "q3": {"cached_tokens": 160}}
    for p in plans[-2:]:   # moved: chunk 0's group holds none of the holders
        assert p["cached_moved"] and p["cached_tokens"] == 160, p
        assert not set(p["chunks"][0]["instances"]) & set(p["cached_instances"]), p
    # q2's prefix came from the prefill pool (the aborted run is kept on no decode instance),
    # q3's from the decode instance keeping q2
    assert cache["decode_reuses"] == before["decode_reuses"] + 1, (before, cache)
    _wait_idle(base, _nothing_in_flight)
    cleared = httpx.delete(f"{base}/admin/prefix_cache", timeout=60).json()
    assert cleared["blocks"] == cleared["sources"] == 0 and cleared["consistent"] is True
    deadline = time.monotonic() + 20
    idle, held = _held_idle(base)
    while not idle and time.monotonic() < deadline:   # cleanups finish asynchronously
        time.sleep(0.2)
        idle, held = _held_idle(base)
    assert idle, json.dumps(held, indent=1)
