"""The control plane's record of runs kept on decode instances (tetris/control/decode_kept.py):
where a prompt's longest kept prefix is, which run covers a plan's cached tokens, LRU bounds."""

from __future__ import annotations

import pytest

from tetris.control.decode_kept import DecodeKept, shared_blocks
from tetris.control.prefix_index import block_hashes

B = 4


def _h(tokens):
    return block_hashes(tokens, B)


def test_routing_covering_and_lru():
    kept = DecodeKept(B, per_instance=2)
    doc = list(range(100, 124))                      # 6 blocks
    turn1 = doc + [7, 8, 9, 10, 11]                   # its KV: 7 blocks and a token
    assert kept.add(0, "t1", _h(turn1)) == []
    assert kept.add(1, "other", _h(list(range(500, 520)))) == []
    turn2 = turn1 + [12, 13, 14, 15, 16, 17]
    assert shared_blocks(_h(turn1), _h(turn2)) == 7
    assert kept.best(_h(turn2)) == (0, "t1", 7)
    assert kept.best(_h(turn2), up=frozenset({1})) is None   # its holder is down
    assert kept.best(_h(list(range(900, 920)))) is None
    # a plan reading 26 cached tokens needs 7 whole blocks held: t1 has them; 29 would need 8
    assert kept.covering(0, _h(turn2), 26) == "t1" and kept.covering(0, _h(turn2), 29) is None
    assert kept.covering(1, _h(turn2), 8) is None and kept.covering(0, _h(turn2), 0) is None
    kept.reused(26)
    assert kept.stats() == {"decode_kept_runs": 2, "decode_reuses": 1, "decode_reused_tokens": 26}
    # the instance keeps two runs: a third lets the least recently used go (t1 was used last)
    assert kept.add(0, "t2", _h(turn2)) == []
    kept.covering(0, _h(turn2), 24)                  # t2, the most recent holder, is used
    assert kept.add(0, "t3", _h(doc)) == ["t1"]
    assert kept.runs() == {0: ["t2", "t3"], 1: ["other"]}
    assert kept.lost(1) == ["other"] and kept.clear() == [(0, "t2"), (0, "t3")]
    assert kept.runs() == {}
    with pytest.raises(ValueError):
        DecodeKept(B, per_instance=0)
