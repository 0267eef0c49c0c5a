"""The first token reaches the decode instance with the KV, not through the dispatcher: when the
prefill run says it streamed the token (``first_token_streamed``), the dispatcher makes no
``commit`` hop; when it did not, the dispatcher commits as before (no Ray: fakes)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from test_dispatcher import FakeDecode, FakePrefill, _collect, _dispatcher, _req


class _StreamedResult(msgspec.Struct):
    first_token: int
    elapsed_s: float
    turn_wait_s: float = 0.0
    first_token_streamed: bool = False


class _TokenWithKV(FakePrefill):
    """The sampling member hands the decode side its first token itself (the transfer's
    ``FirstToken``), and says so in the run's result when ``streamed``."""

    def __init__(self, decode: FakeDecode, streamed: bool) -> None:
        super().__init__()
        self.decode, self.streamed = decode, streamed

    async def run(self, plan, token_ids, sampling, kv_receivers):
        out = await super().run(plan, token_ids, sampling, kv_receivers)
        if self.streamed:
            self.decode.first[plan.request_id] = out.first_token
        return _StreamedResult(out.first_token, out.elapsed_s,
                               first_token_streamed=self.streamed)


class _CountingDecode(FakeDecode):
    def __init__(self) -> None:
        super().__init__()
        self.commits: list[str] = []

    async def commit(self, instance, request_id, first_token) -> None:
        self.commits.append(request_id)
        await super().commit(instance, request_id, first_token)


@pytest.mark.parametrize("streamed", [True, False])
def test_commit_hop_only_when_the_token_did_not_go_with_the_kv(streamed):
    decode = _CountingDecode()
    prefill = _TokenWithKV(decode, streamed)
    d = _dispatcher(prefill, decode)
    outs = asyncio.run(_collect(d, _req("a", 600, 4)))
    assert [o.new_token_ids[0] for o in outs] == [600 % 7 + i for i in range(4)]
    assert outs[-1].finished
    assert decode.commits == ([] if streamed else ["a"])
    assert prefill.released == ["a"] and decode.aborted == []
