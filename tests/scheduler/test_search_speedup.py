"""The optimised CDSP search returns exactly the plans of the pre-optimisation search."""

import random

import pytest

from cdsp_reference import CdspSearch as RefSearch
from cdsp_reference import GroupBuilder as RefBuilder
from cdsp_reference import node_members as ref_node_members
from tetris.scheduler.cdsp import CdspSearch
from tetris.scheduler.extend import GroupBuilder, node_members
from tetris.scheduler.latency import PrefillLatencyModel, SpCoefficients, load_profile


def _profile_to(max_sp: int) -> PrefillLatencyModel:
    base = load_profile("a100-llama3-8b-tp1")
    coeffs = list(base.coefficients)
    top = coeffs[-1]
    s = top.sp_size * 2
    while s <= max_sp:  # as benchmarks/bench_scheduler.py extrapolates past SP 16
        r = s / top.sp_size
        coeffs.append(SpCoefficients(s, top.alpha * r, top.beta / r, top.gamma / r, top.delta / r))
        s *= 2
    return PrefillLatencyModel(coeffs, name="extended")


PROF = _profile_to(128)


def _case(rng: random.Random):
    layout = rng.choice(["uniform", "uniform", "uniform", "uneven"])
    if layout == "uniform":
        node_size = rng.choice([2, 4, 8])
        n = rng.choice([8, 16, 32, 64, 128])
        node_of = [i // node_size for i in range(n)]
    else:  # nodes of different sizes, numbered out of order
        sizes = [rng.choice([2, 4, 6, 8]) for _ in range(rng.randint(2, 5))]
        node_of = [k for k, sz in enumerate(sizes) for _ in range(sz)]
        rng.shuffle(node_of)
        n = len(node_of)
    kind = rng.random()
    if kind < 0.3:     # many ties: a few distinct queue times, some in the past
        q = [rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in range(n)]
    elif kind < 0.4:   # an idle pool
        q = [0.0] * n
    else:
        q = [rng.uniform(0.0, 10.0) for _ in range(n)]
    now = rng.choice([0.0, 0.0, rng.uniform(0.0, 3.0)])
    sizes = [s for s in PROF.sp_sizes if s <= n]
    if rng.random() < 0.2:   # candidates with gaps
        sizes = sorted(set(rng.sample(sizes, rng.randint(1, len(sizes)))))
    theta = rng.choice([0.0, 0.05, 0.15, 0.3, 0.5, 0.75])
    tokens = rng.randint(1000, 262144)
    min_chunk = rng.choice([256, 256, 1024])
    return q, node_of, now, sizes, theta, tokens, min_chunk


def _plans(search_cls, nm, case):
    q, node_of, now, sizes, theta, tokens, min_chunk = case
    def make():
        return search_cls(PROF.table, sizes, q, nm(node_of), now, theta=theta,
                          min_chunk_tokens=min_chunk, chunk_align=64)
    chunked, single = make().plan(tokens), make().single_chunk_plan(tokens)
    return [(r.ttft, r.chunks) for r in (chunked, single)] + [make().options(tokens)]


@pytest.mark.parametrize("block", range(4))
def test_fast_search_matches_reference_on_random_pools(block):
    rng = random.Random(1000 + block)
    chunked = inline_tail = 0
    for _ in range(100):
        case = _case(rng)
        got = _plans(CdspSearch, node_members, case)
        want = _plans(RefSearch, ref_node_members, case)
        assert got == want, case     # same chunks, members in ring order, times to the bit
        chunked += len(got[0][1]) > 1
        # a rest on the largest candidate is evaluated inline rather than by recursion
        last_size = max(s for s in PROF.sp_sizes if s <= len(case[1]))
        inline_tail += len(got[0][1]) > 1 and len(got[0][1][-1][1]) == last_size
    assert chunked >= 10             # the cases exercise the chunked search, not only one chunk
    assert inline_tail >= 3


@pytest.mark.parametrize("seed", range(3))
def test_groups_match_reference_for_any_chain(seed):
    """``extend`` alone, on chains of arbitrary sizes (not only powers of two), uneven and
    out-of-order nodes, ties: members in ring order and max queue equal the reference's."""
    rng = random.Random(seed)
    for _ in range(150):
        q, node_of, *_ = _case(rng)
        n = len(node_of)
        chain = tuple(sorted(rng.sample(range(1, n + 1), rng.randint(1, min(5, n)))))
        got = GroupBuilder(q, node_members(node_of))
        want = RefBuilder(q, ref_node_members(node_of))
        for k in range(1, len(chain) + 1):
            g, w = got.group(chain[:k]), want.group(chain[:k])
            assert (g.members, g.max_queue) == (w.members, w.max_queue), (q, node_of, chain)
        # a plain list topology (as callers built before Topology) gives the same groups
        plain = GroupBuilder(q, [(nd, list(m)) for nd, m in node_members(node_of)])
        assert plain.group(chain).members == got.group(chain).members
