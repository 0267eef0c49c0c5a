"""The live prefix-cache benchmark's prompts: made from the shared-prefix workload's segments,
they share exactly the blocks the simulator's segment hashes say they share, so the emulated
and the simulated runs of one trace hit the same prefixes."""

from __future__ import annotations

from tetris.bench.prefix_live import prompt_tokens
from tetris.control.prefix_index import PrefixIndex
from tetris.sim.prefix_workload import (
    PrefixWorkload,
    shared_prefix_prompts,
    shared_prefix_workload,
)


def _shared(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_live_prompts_share_the_blocks_their_segment_hashes_share():
    spec = PrefixWorkload(documents=2, sessions=1, doc_tokens=(2000, 4000),
                          session_context=(1000, 2000), block_tokens=64)
    items = shared_prefix_prompts(spec, 1.0, seed=3)
    assert [r for r, _ in items] == shared_prefix_workload(spec, 1.0, seed=3)
    index = PrefixIndex(spec.block_tokens, capacity_blocks=16)
    live = [index.hashes(list(prompt_tokens(s))) for _, s in items]
    shared_pairs = 0
    for i, (ri, si) in enumerate(items):
        assert len(prompt_tokens(si)) == ri.prompt_tokens
        assert len(live[i]) == len(ri.block_hashes)
        for j in range(i):
            want = _shared(ri.block_hashes, items[j][0].block_hashes)
            assert _shared(live[i], live[j]) == want
            shared_pairs += want > 0
    assert shared_pairs > 0   # the trace does repeat prefixes
