"""Prompt token ids between processes: one int32 buffer (tetris/token_ids.py)."""

from __future__ import annotations

import pickle
import sys
from array import array

import numpy as np
import pytest

from tetris.token_ids import compact_tokens, token_slices
from tetris.actors.prefill.zigzag import ranges_to_list, zigzag_layout


def test_sequences_become_int32_arrays_and_an_int32_array_is_kept_as_is():
    ids = [0, 1, 255, 256, 128_255, 2**31 - 1, -1]
    for given in (ids, tuple(ids), np.array(ids, dtype=np.int64), np.array(ids, dtype=np.int32)):
        got = compact_tokens(given)
        assert isinstance(got, array) and got.typecode == "i" and got.itemsize == 4
        assert got.tolist() == ids and all(type(t) is int for t in got)
    same = array("i", ids)
    assert compact_tokens(same) is same
    assert compact_tokens(array("q", ids)).tolist() == ids     # other typecodes are converted
    assert compact_tokens([]).tolist() == []


@pytest.mark.parametrize("bad", [[1, 2**31], [1, -2**31 - 1], [1.5], ["7"],
                                 np.array([2**40]), np.array([0.5])])
def test_ids_that_are_not_int32_integers_are_refused(bad):
    with pytest.raises(ValueError, match="token ids must be int32 integers"):
        compact_tokens(bad)


def test_a_long_prompt_costs_four_bytes_a_token_in_memory_and_on_the_wire():
    n = 24_000
    ids = [(7919 * i) % 128_256 for i in range(n)]
    compact = compact_tokens(ids)
    as_tuple = sys.getsizeof(tuple(ids)) + sum(sys.getsizeof(t) for t in ids if t > 256)
    assert sys.getsizeof(compact) < 4 * n + 256
    assert as_tuple > 30 * n
    wire = pickle.dumps(compact, protocol=5)
    assert len(wire) < 4 * n + 256
    back = pickle.loads(wire)
    assert back == compact and back.typecode == "i"


def test_slices_of_zigzag_ranges_match_position_lookup():
    ids = compact_tokens(range(1000, 1100))
    for ranges in zigzag_layout(3, 97, 4):
        got = token_slices(ids, ranges)
        assert isinstance(got, array) and got.typecode == "i"
        assert got.tolist() == [ids[p] for p in ranges_to_list(ranges)]
    assert token_slices(ids, ()).tolist() == []
