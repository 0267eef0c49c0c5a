"""What pipelining a chunk's SP layout over ``M`` micro-partitions saves, priced per layer.

Two executors cut a chunk's communication into ``M`` pieces so that a piece's transfer runs
while an earlier piece is attended (issue #26 item 4):

    a2a/M   CSPS's three-phase pipeline (§3.2.3, Fig. 9a; actors/prefill/alltoall_pipeline.py):
            A2A #1 of range m+1 in flight while range m is attended, then A2A #2 of range m
    ring/M  the ring's KV block in M pieces (actors/prefill/ring_pipeline.py): piece m+1 in
            flight while piece m is attended and forwarded

Both are priced as two resources, the link and the attention, with ``M`` equal pieces; a
layer can end no earlier than either resource's own chain allows:

    a2a/M   T = max(C1/M + A + C2/M,  C1 + C2 + A/M) + 2·(M−1)·o
            the attention chain waits for the first piece's A2A #1 and ends before the last
            piece's A2A #2; the link chain carries every piece and waits for one piece's
            attention. M = 1 gives C1 + A + C2, the unpipelined all-to-all.
    ring/M  T = max(s·A_step,  (s−1)·C + A_step/M) + (s−1)·(M−1)·o
            (docs/csps.md, "The ring over micro-partitions": the own block is attended while
            the first transfer runs, the last step's last piece is attended after its
            arrival). M = 1 gives (s−1)·max(A_step, C) + A_step, the whole-block ring.

``C1``, ``C2``: the two all-to-alls' seconds; ``A``: the member's attention in the layer (Eq. 1's
``γ·h·l + δ·l²`` over the layers); ``C``, ``A_step``: one ring step's transfer and attention
(``A_step = A/s``). ``o``: the fixed cost of one more piece in one exchange: its own message
and its own attention call and merge, which no overlap hides (the CPU benchmark
bench_ring_pipeline.py saw the pieces' CPU cost rise with M; the scheduler's constant is the
deployment's ``message_latency_s``). Pieces are taken as equal; the causal ranges of the
all-to-all are not (later ranges attend more keys), which this ignores.

Both forms are never below ``max(communication, attention)`` and equal the unpipelined layer
at M = 1 (tests/scheduler/test_sp_pipeline.py). Pure: no torch, no Ray.
"""

from __future__ import annotations

__all__ = ["a2a_layer_s", "exposed_a2a_s", "exposed_ring_s", "ring_layer_s"]


def a2a_layer_s(send_s: float, attention_s: float, return_s: float, micro: int,
                piece_overhead_s: float) -> float:
    """One layer of the all-to-all over ``micro`` pieces: A2A #1 ``send_s``, attention,
    A2A #2 ``return_s`` (module docstring)."""
    m = micro
    attention_chain = send_s / m + attention_s + return_s / m
    link_chain = send_s + return_s + attention_s / m
    return max(attention_chain, link_chain) + 2 * (m - 1) * piece_overhead_s


def ring_layer_s(steps: int, transfer_s: float, step_attention_s: float, micro: int,
                 piece_overhead_s: float) -> float:
    """One layer of a ring of ``steps + 1`` members over ``micro`` pieces per block: ``steps``
    transfers of ``transfer_s`` each, ``steps + 1`` attention steps (module docstring)."""
    m, a = micro, step_attention_s
    if m == 1:   # the whole-block ring: each step waits for its block, the last adds its own
        return steps * max(a, transfer_s) + a
    return max((steps + 1) * a, steps * transfer_s + a / m) + steps * (m - 1) * piece_overhead_s


def exposed_a2a_s(send_s: float, attention_s: float, return_s: float, micro: int,
                  piece_overhead_s: float) -> float:
    """The layer's seconds beyond its attention: the all-to-all's exposed communication."""
    return a2a_layer_s(send_s, attention_s, return_s, micro, piece_overhead_s) - attention_s


def exposed_ring_s(steps: int, transfer_s: float, step_attention_s: float, micro: int,
                   piece_overhead_s: float) -> float:
    """The layer's seconds beyond its ``steps + 1`` attention steps: the ring's exposed
    communication (never negative)."""
    layer = ring_layer_s(steps, transfer_s, step_attention_s, micro, piece_overhead_s)
    return max(0.0, layer - (steps + 1) * step_attention_s)
