"""The handle API's request on the wire: its prompt ids travel as one int32 buffer."""

from __future__ import annotations

import pickle
import sys
from array import array

import pytest
import ray.cloudpickle

from tetris.sampling_params import SamplingParams
from tetris.serve.types import GenerationRequest


@pytest.mark.parametrize("dumps", [pickle.dumps, ray.cloudpickle.dumps], ids=["pickle", "cloudpickle"])
def test_prompt_ids_unpickle_as_one_int32_buffer_with_every_field_kept(dumps):
    ids = tuple(range(1000, 1000 + 5000))
    req = GenerationRequest(prompt_token_ids=ids, request_id="r-1",
                            sampling=SamplingParams(max_tokens=7, temperature=0.5))
    got = pickle.loads(dumps(req))
    assert isinstance(got.prompt_token_ids, array) and got.prompt_token_ids.typecode == "i"
    assert tuple(got.prompt_token_ids) == ids
    assert (got.request_id, got.sampling, got.prompt) == ("r-1", req.sampling, None)
    text = pickle.loads(dumps(GenerationRequest(prompt="hello")))
    assert text.prompt == "hello" and text.prompt_token_ids is None


def test_the_receiver_allocates_no_object_per_token():
    """What the ingress pays to unpickle a 50k-token prompt: a tuple of ints costs an int object
    per token (ids past 256 are not cached), the int32 buffer a handful of blocks."""
    ids = (1000,) * 50_000
    as_tuple = pickle.dumps(ids)               # what the request carried before
    as_request = pickle.dumps(GenerationRequest(prompt_token_ids=ids))

    def blocks_kept(blob: bytes) -> int:
        before = sys.getallocatedblocks()
        obj = pickle.loads(blob)
        grown = sys.getallocatedblocks() - before
        del obj
        return grown

    # The count is the whole process's: another thread (Ray's, after earlier tests) may free a
    # few blocks meanwhile (a full run once saw 49,998), so "one per token" with a little slack.
    assert blocks_kept(as_tuple) >= 49_000
    assert blocks_kept(as_request) < 100
    assert len(as_request) < 4 * 50_000 + 1000   # 4 bytes a token on the wire


def test_ids_that_are_not_int32_travel_as_given_for_the_server_to_reject():
    for bad in ((1, 2 ** 40), (1, "x")):
        got = pickle.loads(pickle.dumps(GenerationRequest(prompt_token_ids=bad)))
        assert got.prompt_token_ids == bad
    with pytest.raises(ValueError, match="exactly one"):   # and the checks still run on construction
        GenerationRequest(prompt="a", prompt_token_ids=[1])
