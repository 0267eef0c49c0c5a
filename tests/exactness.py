"""Exactness of a distributed or alternate path against the single engine: tokens equal, and
every token's logprobs close.

Greedy tokens alone are too coarse on the seeded tiny models: their next token depends mostly
on the current one, so a path that drops remote attention partials entirely, or attends to a
wrong piece of history, can still give the engine's greedy tokens. A token's logprob is read
off the whole logits row (``tetris.engine.logprobs``), so a wrong attention term moves it far
past fp32 rounding.

Tolerance: the project's fp32 bound is 1e-4 relative to the logits. A logprob moves as much as
the logits do, but the tiny models' logits are small (|logit| < 0.7) beside their nearly
uniform logprobs (about -ln V = -5.7), so the bound here is 1e-5 relative to the logprob (5e-5
absolute at -5.4). Measured on the TP-2 sharded decode: 5e-7 apart when right; 8e-4 to 1.6e-3
apart with every remote attention partial dropped (while the greedy tokens stayed the same).

``engine_runs`` gives the single engine's (tokens, logprobs); a path that returns logprobs
(the decode engine and instances, the cluster's token path) is checked with
``assert_same_run``, one that exposes logits with ``logprobs_of_logits`` first, and an OpenAI
response with ``assert_api_logprobs``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tetris.engine.logprobs import logprobs_of_rows
from tetris.engine.request import TokenLogprob

RTOL = 1e-5       # relative to the logprob; absolute below 1
TOP = 5            # top logprobs asked for: the logits row beyond the token's own entry


def close(got: float, want: float) -> bool:
    return abs(got - want) <= RTOL * max(1.0, abs(want))


def engine_runs(engine, prompts: Sequence[Sequence[int]], params, prefix: str = "exact"
                ) -> list[tuple[list[int], list[TokenLogprob]]]:
    """The single engine's tokens and logprobs per prompt (``params.logprobs`` set), stepped
    together as one batch; requests of others on the same engine are left running."""
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    runs: dict[str, tuple[list[int], list[TokenLogprob]]] = {rid: ([], []) for rid in ids}
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, list(prompt), params)
    left = set(ids)
    while left:
        for out in engine.step():
            if out.request_id in runs:
                runs[out.request_id][0].extend(out.new_token_ids)
                runs[out.request_id][1].extend(out.new_logprobs)
                if out.finished:
                    left.discard(out.request_id)
    return [runs[rid] for rid in ids]


def logprobs_of_logits(rows: Sequence[torch.Tensor], tokens: Sequence[int],
                       n: int = TOP) -> list[TokenLogprob]:
    """What the engine reports for ``tokens`` given the logits row [V] each was sampled from."""
    return logprobs_of_rows(torch.stack([r.float() for r in rows]), tokens, n)


def assert_logprob_close(got: TokenLogprob, want: TokenLogprob, where: str = "") -> None:
    """Same token; its logprob and the top ones close. A top token may differ from the
    engine's only where two logprobs tie within the tolerance (then at the same value)."""
    assert got.token_id == want.token_id, f"{where}: token {got.token_id} != {want.token_id}"
    assert close(got.logprob, want.logprob), \
        f"{where}: logprob {got.logprob:.6f} != engine's {want.logprob:.6f}"
    assert len(got.top) == len(want.top), f"{where}: {len(got.top)} top != {len(want.top)}"
    want_top = dict(want.top)
    for rank, ((tok, value), (_, want_value)) in enumerate(zip(got.top, want.top)):
        assert close(value, want_value), \
            f"{where}: top {rank} logprob {value:.6f} != engine's {want_value:.6f}"
        assert close(value, want_top.get(tok, want.top[-1][1])), \
            f"{where}: top {rank} token {tok} is not among the engine's"


def assert_same_run(got_tokens: Sequence[int], got_logprobs: Sequence[TokenLogprob],
                    want: tuple[Sequence[int], Sequence[TokenLogprob]], what: str = "") -> None:
    """Tokens equal the engine's, and every token's logprobs are close to the engine's."""
    want_tokens, want_logprobs = want
    assert list(got_tokens) == list(want_tokens), f"{what}: tokens differ from the engine's"
    assert len(got_logprobs) == len(want_logprobs) == len(want_tokens), \
        f"{what}: {len(got_logprobs)} logprobs for {len(want_tokens)} tokens"
    for i, (g, w) in enumerate(zip(got_logprobs, want_logprobs)):
        assert_logprob_close(g, w, f"{what} token {i}")


def assert_api_logprobs(got: dict, want: tuple[Sequence[int], Sequence[TokenLogprob]],
                        text_of: Callable[[int], str], what: str = "") -> None:
    """An OpenAI completion choice's ``logprobs`` against the engine's: token texts equal,
    each token's logprob and its top logprobs (keyed by text; the token itself included, as
    the API reports it) close."""
    tokens, entries = want
    assert got["tokens"] == [text_of(t) for t in tokens], f"{what}: tokens differ"
    for i, (lp, top, e) in enumerate(zip(got["token_logprobs"], got["top_logprobs"], entries,
                                         strict=True)):
        assert close(lp, e.logprob), f"{what} token {i}: logprob {lp:.6f} != {e.logprob:.6f}"
        expected: dict[str, float] = {}
        for t, v in e.top:
            expected.setdefault(text_of(t), v)
        expected.setdefault(text_of(e.token_id), e.logprob)
        assert top.keys() == expected.keys(), f"{what} token {i}: top tokens differ"
        assert all(close(top[k], expected[k]) for k in top), f"{what} token {i}: top logprobs"
