"""KunServe served end to end over HTTP (issue #24; Ray Serve, the SP pool, NIXL streaming):
the tiny cluster with two TP-1 decode instances of 32 KV blocks (512 tokens) each under
``[kunserve] enabled`` (a 48-block landing zone, the monitor's period long enough that only
the operator and the overload hook decide): ``configs/kunserve-tiny-cpu.toml``'s decode pool.

- Streamed requests of mixed lengths (greedy, and one seeded sampled) run across a forced
  drop of both instances into one pipeline group and a forced restore, in the middle of
  generation: every token and logprob over ``/v1/completions`` equals the single engine's,
  and while dropped the members decode through the pipeline without computing a prompt token.
- A 600-token prompt needs 38 blocks, more than either undropped instance has at all (the
  decode pool's ``DecodeFull``, a 429, as ``test_app_elastic`` shows beyond capacity): the
  overload hook drops the two instances into a group and the prompt lands and is served
  exactly; ``tetris:dropped_layers`` is 2 per instance while dropped. The same prompt at an
  otherwise idle app (whose free blocks cover it) is served by a drop too.
- A forced drop that would lose a layer's last copy is a 400 and changes nothing.
- A member killed mid-pipeline: every running request of the group takes the resume path
  and ends with the engine's tokens; the survivor is rebuilt in place (same rank actor, not
  restarted), the dead member restarted by the supervisor, the group gone.
Nothing is held once idle. One app for the module.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import msgspec
import pytest
from cluster_configs import MODEL, write_tiny_cluster
from exactness import TOP, assert_api_logprobs, engine_runs
from served_held import assert_idle_soon

from tetris.config import load_deployment
from tetris.engine.engine import LLMEngine
from tetris.sampling_params import SamplingParams
from tetris.serve.logprobs_format import TokenText

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

BLOCKS = 32         # per decode instance: 512 tokens of 16
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 1.3, "top_k": 40, "seed": 21}


def _write_deployment(tmp) -> str:
    path = Path(write_tiny_cluster(tmp, """
[kunserve]
enabled = true
monitor_s = 600.0
landing_blocks = 48
"""))
    text = path.read_text()
    for old, new in (("[decode]\nnum_instances = 1\ntp_size = 2\nkv_blocks = 512\n",
                      f"[decode]\nnum_instances = 2\ntp_size = 1\nkv_blocks = {BLOCKS}\n"),
                     # two prefill instances: the app starts sooner; SP 1 and 2
                     ("[prefill]\nnum_instances = 4\n", "[prefill]\nnum_instances = 2\n"),
                     ("sp_candidates = [1, 2, 4]", "sp_candidates = [1, 2]")):
        assert old in text
        text = text.replace(old, new)
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def app(serve_http, tmp_path_factory):
    from ray import serve

    from tetris.serve.app import APP_NAME, build_app

    cfg = load_deployment(_write_deployment(tmp_path_factory.mktemp("kunserve")))
    # the decode pool and KunServe of the config shipped for newcomers, as tested here
    shipped = load_deployment("kunserve-tiny-cpu.toml")
    assert shipped.decode == cfg.decode and shipped.kunserve == msgspec.structs.replace(
        cfg.kunserve, monitor_s=30.0)
    assert shipped.model.seed == cfg.model.seed and shipped.model.num_layers == 4
    serve.run(build_app(cfg, max_pending=16), name=APP_NAME, route_prefix="/")
    # the pools wired and KunServe's driver started before the first test's clock runs
    serve.get_deployment_handle("DispatcherServer", APP_NAME).warmup.remote().result()
    yield cfg, serve_http
    serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def engine(app):
    cfg, _ = app
    return LLMEngine.from_deployment(cfg, num_blocks=256)


def _tokens(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 11) % 500 + 3 for i in range(n)]


def _wants(engine, batch) -> dict:
    """The single engine's (tokens, logprobs) per request of ``batch`` (name, prompt, max
    tokens, sampling), stepped as one batch per sampling (the greedy ones, the seeded one)."""
    out = {}
    for sampling in (GREEDY, SEEDED):
        same = [(name, p, n) for name, p, n, s in batch if s == sampling]
        if not same:
            continue
        params = SamplingParams(max_tokens=max(n for *_, n in same), ignore_eos=True,
                                logprobs=TOP, **sampling)
        runs = engine_runs(engine, [p for _, p, _ in same], params, f"want-{len(out)}")
        out |= {name: (t[:n], lp[:n]) for (name, _, n), (t, lp) in zip(same, runs, strict=True)}
    return out


class HttpStreams:
    """Streamed completions over HTTP: each one's tokens (with their logprobs) as they arrive;
    ``reached(n)`` waits until every stream has n tokens or finished."""

    def __init__(self, base: str, names) -> None:
        self.base = base
        self.logprobs: dict[str, dict[str, list]] = {
            name: {"tokens": [], "token_logprobs": [], "top_logprobs": []} for name in names}
        self.finished: set[str] = set()
        self.changed = asyncio.Event()

    def count(self, name: str) -> int:
        return len(self.logprobs[name]["tokens"])

    async def run(self, client, name: str, prompt, n: int, sampling: dict) -> None:
        got = self.logprobs[name]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "ignore_eos": True,
                "logprobs": TOP, "stream": True, **sampling}
        try:
            async with client.stream("POST", f"{self.base}/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    for c in json.loads(line[len("data: "):])["choices"]:
                        for key, values in got.items():
                            values.extend(c["logprobs"][key])
                    self.changed.set()
        finally:
            self.finished.add(name)
            self.changed.set()

    async def reached(self, n: int, names=None) -> dict[str, int]:
        while not all(self.count(k) >= n or k in self.finished
                      for k in (names or self.logprobs)):
            self.changed.clear()
            await self.changed.wait()
        return {k: self.count(k) for k in sorted(self.logprobs)}


def _dropped(metrics: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith("tetris:dropped_layers{")]


# (name, prompt, max tokens, sampling): a batch of mixed lengths, one seeded sampled
BATCH = [("g5", _tokens(5, 1), 40, GREEDY), ("g40", _tokens(40, 2), 40, GREEDY),
         ("g130", _tokens(130, 3), 40, GREEDY), ("g260", _tokens(260, 4), 40, GREEDY),
         ("s70", _tokens(70, 5), 40, SEEDED)]


def test_tokens_over_http_equal_the_engine_across_a_forced_drop_and_restore(app, engine):
    _, base = app
    want = _wants(engine, BATCH)
    streams = HttpStreams(base, want)

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            tasks = [asyncio.ensure_future(streams.run(c, name, p, n, s))
                     for name, p, n, s in BATCH]
            await streams.reached(2)
            drop = await c.post(f"{base}/admin/kunserve/drop", json={"groups": [[0, 1]]})
            at_drop = {k: streams.count(k) for k in sorted(streams.logprobs)}
            metrics = (await c.get(f"{base}/metrics/kunserve")).text
            await streams.reached(min(at_drop.values()) + 4)
            during = (await c.get(f"{base}/admin/kunserve")).json()
            restore = await c.post(f"{base}/admin/kunserve/restore", json={"leader": 0})
            at_restore = {k: streams.count(k) for k in sorted(streams.logprobs)}
            await asyncio.gather(*tasks)
            return drop, at_drop, metrics, during, restore, at_restore

    drop, at_drop, metrics, during, restore, at_restore = asyncio.run(run())
    assert drop.status_code == 200, drop.text
    assert drop.json()["dropped_layers"] == {"0": 2, "1": 2}
    assert _dropped(metrics) == [2.0, 2.0]
    # the slowest stream runs across the drop and the restore (tokens the client had then)
    assert min(at_drop.values()) < 40 and min(at_restore.values()) < 40, (at_drop, at_restore)
    # while dropped the slowest stream decoded through the pipeline (its owner's steps, the
    # other member's stage runs; a member whose own streams all ended before the drop may
    # have had none), and no member computed a prompt token (the KV was exchanged)
    members = during["members"]
    assert all(m["in_group"] and m["dropped_layers"] == 2 for m in members), members
    assert all(m["prefill_tokens"] == 0 for m in members), members
    assert any(m["steps"] > 0 for m in members) and any(m["stage_runs"] > 0 for m in members)
    assert restore.status_code == 200, restore.text
    assert restore.json()["dropped_layers"] == {"0": 0, "1": 0}
    text = TokenText(engine.tokenizer)
    for name, *_ in BATCH:
        assert_api_logprobs(streams.logprobs[name], want[name], text, name)
    assert_idle_soon(base)


def test_a_prompt_refused_for_kv_without_kunserve_is_served_by_a_drop(app, engine):
    cfg, base = app
    big = _tokens(600, 6)
    blocks = -(-(len(big) + 1) // cfg.decode.block_size)
    view = httpx.get(f"{base}/admin/kunserve", timeout=60).json()
    # more blocks than either instance holds at all: undropped, DecodeFull (a 429)
    assert [g["kv_blocks"] for g in view["groups"]] == [BLOCKS, BLOCKS] and blocks > BLOCKS
    fillers = [("f1", _tokens(260, 7), 32, GREEDY), ("f2", _tokens(200, 8), 32, GREEDY),
               ("big", big, 16, GREEDY)]
    want = _wants(engine, fillers)
    streams = HttpStreams(base, want)

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            tasks = [asyncio.ensure_future(streams.run(c, name, p, n, s))
                     for name, p, n, s in fillers[:2]]
            await streams.reached(2, ["f1", "f2"])
            await streams.run(c, *fillers[2])
            metrics = (await c.get(f"{base}/metrics/kunserve")).text
            view = (await c.get(f"{base}/admin/kunserve")).json()
            await asyncio.gather(*tasks)
            restore = await c.post(f"{base}/admin/kunserve/restore", json={"leader": 0})
            return metrics, view, restore

    metrics, view, restore = asyncio.run(run())
    assert _dropped(metrics) == [2.0, 2.0]            # the overload hook dropped
    assert [g["members"] for g in view["groups"]] == [[0, 1]]   # undropped before it came
    assert view["members"][0]["landed"] + view["members"][1]["landed"] == 1
    text = TokenText(engine.tokenizer)
    for name, *_ in fillers:
        assert_api_logprobs(streams.logprobs[name], want[name], text, name)
    assert restore.status_code == 200, restore.text
    assert restore.json()["dropped_layers"] == {"0": 0, "1": 0}
    assert_idle_soon(base)


def test_a_prompt_larger_than_either_instance_at_an_idle_app_is_served_by_a_drop(app, engine):
    """Nothing else runs: the pool's 64 free blocks cover the prompt's 38, but no instance can
    take it at all, so the hook's tick asks the controller for a unit that can (``fit_blocks``):
    one merge, a member's part of the group's blocks, at most the 48-block landing zone."""
    cfg, base = app
    big = _tokens(600, 11)
    assert -(-(len(big) + 1) // cfg.decode.block_size) > BLOCKS
    view = httpx.get(f"{base}/admin/kunserve", timeout=60).json()
    assert [g["members"] for g in view["groups"]] == [[0], [1]], view
    assert_idle_soon(base)
    batch = [("big", big, 16, GREEDY)]
    want = _wants(engine, batch)
    streams = HttpStreams(base, want)

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            await streams.run(c, *batch[0])
            metrics = (await c.get(f"{base}/metrics/kunserve")).text
            view = (await c.get(f"{base}/admin/kunserve")).json()
            restore = await c.post(f"{base}/admin/kunserve/restore", json={"leader": 0})
            return metrics, view, restore

    metrics, view, restore = asyncio.run(run())
    assert _dropped(metrics) == [2.0, 2.0]
    assert [g["members"] for g in view["groups"]] == [[0, 1]]
    assert view["members"][0]["landed"] + view["members"][1]["landed"] == 1
    assert_api_logprobs(streams.logprobs["big"], want["big"], TokenText(engine.tokenizer), "big")
    assert restore.status_code == 200, restore.text
    assert_idle_soon(base)


def test_a_drop_losing_a_layer_is_a_400_and_changes_nothing(app):
    _, base = app
    before = httpx.get(f"{base}/admin/kunserve", timeout=60).json()
    r = httpx.post(f"{base}/admin/kunserve/drop", timeout=60,
                   json={"groups": [[0, 1]], "layer_ranges": [[[0, 2], [3, 4]]]})
    assert r.status_code == 400 and "layer" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{base}/admin/kunserve", timeout=60).json() == before
    assert before["dropped_layers"] == {"0": 0, "1": 0}


def test_a_member_killed_mid_pipeline_resumes_its_requests_and_the_survivor_is_rebuilt(
        app, engine):
    """Runs last: rank 0 of instance 1 is killed while four requests stream from the group.
    The KV of its layers for all of them is gone: each takes the dispatcher's resume path
    (prefilled again with the tokens its client has) and ends with the engine's tokens and
    logprobs. Instance 0 is rebuilt in place (the same rank actor: no restart), instance 1
    restarted with a new one, and the group is let go; the two can be grouped again."""
    import ray
    from ray import serve

    from tetris.serve.app import APP_NAME

    _, base = app
    decode = serve.get_deployment_handle("DecodePoolServer", APP_NAME)
    dispatcher = serve.get_deployment_handle("DispatcherServer", APP_NAME)
    old = decode.peers.remote().result()
    # small enough that the resumed requests fit one instance while the other restarts
    batch = [(name, p, 64, s) for name, p, _, s in BATCH if name != "g260"]
    want = _wants(engine, batch)
    streams = HttpStreams(base, want)

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            tasks = [asyncio.ensure_future(streams.run(c, name, p, n, s))
                     for name, p, n, s in batch]
            await streams.reached(2)
            drop = await c.post(f"{base}/admin/kunserve/drop", json={"groups": [[0, 1]]})
            assert drop.status_code == 200, drop.text
            at_kill = await streams.reached(min(streams.count(k) for k in want) + 2)
            ray.kill(old[1][0])    # decode instance 1's only rank
            await asyncio.gather(*tasks)
            return at_kill

    at_kill = asyncio.run(run())
    assert min(at_kill.values()) < 64, at_kill
    deadline = time.monotonic() + 240
    view = httpx.get(f"{base}/admin/kunserve", timeout=60).json()
    while view["restarts"][1] < 1:   # the supervisor restarts the dead member
        assert time.monotonic() < deadline, view
        time.sleep(0.5)
        view = httpx.get(f"{base}/admin/kunserve", timeout=60).json()
    text = TokenText(engine.tokenizer)
    for name, run in want.items():
        assert_api_logprobs(streams.logprobs[name], run, text, name)
    assert_idle_soon(base)   # every run's cleanup is done: its timeline is kept
    # every request still running at the kill was run again (once: nothing else died)
    lengths = {len(p): name for name, p, _, _ in batch}
    runs = {lengths[t["prompt_tokens"]]: t for t in dispatcher.timelines.remote(50).result()
            if t["prompt_tokens"] in lengths}
    assert sorted(runs) == sorted(want)
    assert all(t["outcome"] == "length" for t in runs.values()), runs
    slowest = min(at_kill, key=at_kill.get)   # far from its end at the kill: it was running
    assert runs[slowest]["retries"] == 1 and all(t["retries"] <= 1 for t in runs.values()), runs
    assert view["rebuilt_in_place"] == [0] and view["restarts"] == [0, 1], view
    assert [g["members"] for g in view["groups"]] == [[0], [1]]
    assert view["dropped_layers"] == {"0": 0, "1": 0}
    new = decode.peers.remote().result()
    assert new[0][0]._actor_id == old[0][0]._actor_id     # the survivor: same actor
    assert new[1][0]._actor_id != old[1][0]._actor_id     # the dead member: a new one
    # both serve whole again, and the survivor drops with the new member into a group that
    # serves (a prefilled prompt lands on a member and decodes through the pipeline)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for salt, dropped in ((9, [0.0, 0.0]), (10, [2.0, 2.0])):
        if dropped[0]:
            r = httpx.post(f"{base}/admin/kunserve/drop", json={"groups": [[0, 1]]}, timeout=60)
            assert r.status_code == 200, r.text
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": _tokens(90, salt), "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == engine.generate([_tokens(90, salt)],
                                                                 params)[0].text
        assert _dropped(httpx.get(f"{base}/metrics/kunserve", timeout=60).text) == dropped
    r = httpx.post(f"{base}/admin/kunserve/restore", json={"leader": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert_idle_soon(base)
