"""Shared-prefix traffic for prefix caching (issue #23): documents asked several questions, and
multi-turn sessions whose every turn resends the conversation so far.

A prompt is a list of *segments* (a document, a question, one turn's user message or answer),
each ``(key, tokens)`` with a key naming its content. Block ``k``'s hash chains block
``k - 1``'s hash with the pieces of segments the block covers (``key``, offset, length): two
prompts share a block hash exactly when they share the whole prefix up to that block's end,
as token hashes would (``tetris.control.prefix_index.block_hashes``), without materialising
128k-token prompts.

Streams:

- a document of ``doc_tokens`` (uniform) with ``questions`` (uniform) questions, each prompt
  ``document + question``;
- a session of ``session_turns`` turns: turn ``t`` is ``context + Σ_{k<t} (user_k + answer_k)
  + user_t``, where ``answer_k`` has turn ``k``'s output length.

Arrivals are a seeded Poisson process. ``concurrent_streams`` streams (users) are active at
once, the next in a seeded order starting when one has sent its last item; each arrival
belongs to an active stream drawn uniformly, so a stream's items keep their order and
interleave with the other active streams'. Trace files in the Mooncake format (JSONL: ``timestamp`` in ms,
``input_length``, ``output_length``, ``hash_ids``) are written and read here.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import msgspec
import numpy as np

from tetris.control.prefix_index import chain_hash
from tetris.sim.workload import OUTPUT_LENGTHS, LengthDistribution, SimRequest

__all__ = [
    "PrefixWorkload",
    "answer_key",
    "decode_kept_hashes",
    "load_mooncake_trace",
    "save_mooncake_trace",
    "segment_hashes",
    "shared_prefix_prompts",
    "shared_prefix_workload",
]

Segment = tuple[str, int]   # (content key, tokens)


class PrefixWorkload(msgspec.Struct, frozen=True):
    """Sizes of a shared-prefix workload (token ranges inclusive, uniform)."""

    documents: int = 100
    sessions: int = 50
    doc_tokens: tuple[int, int] = (32768, 131072)
    questions: tuple[int, int] = (4, 8)
    question_tokens: tuple[int, int] = (64, 512)
    session_turns: tuple[int, int] = (3, 6)
    session_context: tuple[int, int] = (4096, 32768)
    turn_tokens: tuple[int, int] = (64, 512)
    block_tokens: int = 512
    concurrent_streams: int = 8   # streams (users) active at once; the next starts as one ends


def segment_hashes(segments: list[Segment], block_tokens: int) -> tuple[int, ...]:
    """Chained hashes of the whole blocks of a prompt made of ``segments``."""
    out, parent = [], 0
    pieces: list[bytes] = []
    filled = 0
    for key, tokens in segments:
        offset = 0
        while offset < tokens:
            take = min(tokens - offset, block_tokens - filled)
            name = key.encode()
            pieces.append(struct.pack("<H", len(name)) + name + struct.pack("<qq", offset, take))
            offset += take
            filled += take
            if filled == block_tokens:
                parent = chain_hash(parent, b"|".join(pieces))
                out.append(parent)
                pieces, filled = [], 0
    return tuple(out)


def answer_key(segments: list[Segment]) -> str:
    """The content key of the answer to a prompt: turn ``t``'s user message ``.../user<t>``
    is answered by ``.../answer<t>`` (resent by the next turn); any other prompt by its last
    segment's key and ``/answer``."""
    head, _, last = segments[-1][0].rpartition("/")
    if last.startswith("user"):
        return f"{head}/answer{last[4:]}"
    return f"{segments[-1][0]}/answer"


def decode_kept_hashes(items: list[tuple[SimRequest, list[Segment]]],
                       block_tokens: int) -> dict[str, tuple[int, ...]]:
    """Per request, the block hashes of the KV its decode instance keeps once it completes
    (decode-side reuse): its prompt and its answer but the answer's last token, whose KV is
    never computed."""
    return {r.request_id: segment_hashes(segs + [(answer_key(segs), r.output_tokens - 1)],
                                         block_tokens)
            for r, segs in items}


def _uniform(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    return int(rng.integers(lo_hi[0], lo_hi[1] + 1))


def _streams(spec: PrefixWorkload, rng: np.random.Generator,
             outputs: LengthDistribution) -> list[list[tuple[list[Segment], int]]]:
    """Each stream's items in order: (segments, output tokens)."""
    streams = []
    for d in range(spec.documents):
        doc = (f"doc{d}", _uniform(rng, spec.doc_tokens))
        n = _uniform(rng, spec.questions)
        outs = outputs.sample(rng, n)
        streams.append([([doc, (f"doc{d}/q{j}", _uniform(rng, spec.question_tokens))],
                         int(outs[j])) for j in range(n)])
    for s in range(spec.sessions):
        history: list[Segment] = [(f"ses{s}/ctx", _uniform(rng, spec.session_context))]
        n = _uniform(rng, spec.session_turns)
        outs = outputs.sample(rng, n)
        items = []
        for t in range(n):
            prompt = history + [(f"ses{s}/user{t}", _uniform(rng, spec.turn_tokens))]
            items.append((prompt, int(outs[t])))
            history = prompt + [(answer_key(prompt), int(outs[t]))]
        streams.append(items)
    return streams


def shared_prefix_workload(spec: PrefixWorkload, rate: float, seed: int,
                           outputs: LengthDistribution = OUTPUT_LENGTHS) -> list[SimRequest]:
    """The requests of every stream, Poisson arrivals at ``rate`` req/s; the same seed gives
    the same requests at any rate (unit-rate gaps divided by ``rate``)."""
    return [r for r, _ in shared_prefix_prompts(spec, rate, seed, outputs)]


def shared_prefix_prompts(spec: PrefixWorkload, rate: float, seed: int,
                          outputs: LengthDistribution = OUTPUT_LENGTHS,
                          ) -> list[tuple[SimRequest, list[Segment]]]:
    """``shared_prefix_workload`` with each request's segments, from which a live run makes
    its prompt's tokens (the same requests, the same hashes' sharing)."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    rng = np.random.default_rng(seed)
    streams = _streams(spec, rng, outputs)
    pending = [streams[k] for k in rng.permutation(len(streams))]
    total = sum(len(s) for s in streams)
    arrivals = np.cumsum(rng.exponential(1.0, size=total)) / rate
    picks = rng.random(total)
    active: list[list] = []
    out = []
    for i in range(total):
        while len(active) < spec.concurrent_streams and pending:
            active.append(list(pending.pop(0)))
        k = int(picks[i] * len(active))
        segments, output = active[k].pop(0)
        if not active[k]:
            active.pop(k)
        out.append((SimRequest(f"r{i}", float(arrivals[i]), sum(t for _, t in segments), output,
                               segment_hashes(segments, spec.block_tokens)), segments))
    return out


def save_mooncake_trace(requests: list[SimRequest], path: str | Path) -> None:
    """JSONL in the Mooncake trace's fields; hashes become dense ids in order of appearance."""
    ids: dict[int, int] = {}
    lines = []
    for r in requests:
        hids = [ids.setdefault(h, len(ids)) for h in r.block_hashes]
        lines.append(json.dumps({"timestamp": round(r.arrival_time * 1000),
                                 "input_length": r.prompt_tokens,
                                 "output_length": r.output_tokens, "hash_ids": hids}))
    Path(path).write_text("".join(line + "\n" for line in lines))


def load_mooncake_trace(path: str | Path) -> list[SimRequest]:
    """A Mooncake-format JSONL trace; ``hash_ids`` are taken as the block hashes (in that
    format an id names a whole prefix), so the index's ``block_tokens`` must be the trace's."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        out.append(SimRequest(f"r{i}", row["timestamp"] / 1000.0, int(row["input_length"]),
                              int(row["output_length"]),
                              tuple(int(h) for h in row.get("hash_ids", ()))))
    return sorted(out, key=lambda r: r.arrival_time)
