"""PoolState snapshots, Eq. 2 commits through the control plane's queue, and topology-aware
extend."""

from __future__ import annotations

import pytest

from tetris.control import PrefillQueue
from tetris.plan import Chunk, PlanError, PrefillPlan
from tetris.scheduler.extend import GroupBuilder, node_members
from tetris.scheduler.pool import PoolError, PoolState


def test_commit_holds_each_chunk_group_until_its_end():
    queue = PrefillQueue([0, 0, 1, 1])
    queue.hold([1], 5.0)
    plan = PrefillPlan("r", 100, (Chunk(0, 40, (0,), 0.0, 1.0), Chunk(40, 100, (0, 2, 3), 1.0, 3.0)))
    before = queue.pool_state(0.0)
    queue.commit(plan)
    assert queue.pool_state(0.0).queue_times == [3.0, 5.0, 3.0, 3.0]
    assert before.queue_times == [0.0, 5.0, 0.0, 0.0]  # a snapshot is independent
    with pytest.raises(PlanError):
        queue.commit(PrefillPlan("bad", 10, (Chunk(0, 10, (7,), 0.0, 1.0),)))


def test_pool_validation():
    with pytest.raises(PoolError):
        PoolState.uniform(6, 4)
    with pytest.raises(PoolError):
        PoolState([0.0, 1.0], [0])
    assert PoolState.uniform(16, 8).node_size == 8


def _builder(queues, node_size):
    return GroupBuilder(queues, node_members([i // node_size for i in range(len(queues))]))


def test_one_node_rule_takes_node_with_smallest_sth_queue():
    # node 0: queues 0,0,9,9   node 1: 1,1,1,1
    b = _builder([0, 0, 9, 9, 1, 1, 1, 1], 4)
    assert b.group((2,)).members == (0, 1)       # 2nd shortest: node0 0 < node1 1
    assert b.group((4,)).members == (4, 5, 6, 7)  # 4th shortest: node0 9 > node1 1
    assert b.group((4,)).max_queue == 1


def test_growth_keeps_members_first_and_prefers_their_nodes():
    b = _builder([0, 0, 9, 9, 1, 1, 1, 1], 4)
    g2 = b.group((2,))
    g4 = b.group((2, 4))
    assert g4.members[:2] == g2.members
    # Rule 2: fill node 0 (the only node G uses) before touching node 1.
    assert g4.members == (0, 1, 2, 3)
    assert g4.max_queue == 9
    g8 = b.group((2, 4, 8))
    assert g8.members == (0, 1, 2, 3, 4, 5, 6, 7)


def test_whole_nodes_then_remainder():
    # nodes of 2: node0 (5,5) node1 (0,7) node2 (1,1) node3 (0,0)
    b = _builder([5, 5, 0, 7, 1, 1, 0, 0], 2)
    g = b.group((4,))
    assert sorted(g.members) == [4, 5, 6, 7]  # the two nodes with the shortest full-node queue
    g3 = b.group((3,))
    # whole node 3 (full queue 0), then one instance: node1's 1st shortest (0) beats node2's (1)
    assert sorted(g3.members) == [2, 6, 7]
    with pytest.raises(ValueError):
        b.group((16,))


def test_uneven_nodes_take_whole_nodes_then_one():
    # node 0 has 4 instances, node 1 has 2, node 2 has 2 (instances interleaved on purpose)
    node_of = [0, 1, 0, 2, 0, 1, 0, 2]
    b = GroupBuilder([0.0] * 8, node_members(node_of))
    assert sorted(b.group((4,)).members) == [0, 2, 4, 6]
    g6 = b.group((6,))  # no node fits 6: whole node 0 (largest on ties), then a node of 2
    assert sorted(g6.members) == [0, 1, 2, 4, 5, 6]
    assert b.group((2, 6)).members[:2] == b.group((2,)).members


def test_equal_instance_sets_share_one_group_but_keep_their_ring_order():
    # node 0: queues 3,0,1,2 -> by queue: 1,2,3,0
    b = _builder([3.0, 0.0, 1.0, 2.0, 9.0, 9.0, 9.0, 9.0], 4)
    two_then_four, four = b.chain((2, 4))[-1], b.chain((4,))[-1]
    assert two_then_four is four                      # one object: its extensions are shared
    assert b.group((2, 4)).members == (1, 2, 0, 3)    # the SP-2 ring first, then the rest
    assert b.group((4,)).members == (0, 1, 2, 3)      # built at once: by index
    assert b.group((2, 4)).max_queue == b.group((4,)).max_queue == 3.0
    with pytest.raises(ValueError):
        b.extend(four, 2)                             # groups never shrink


def test_topology_is_the_plain_node_list_with_its_layout():
    top = node_members([0, 0, 1, 1])
    assert top == [(0, [0, 1]), (1, [2, 3])]
    assert top.spans == [(0, 2), (2, 4)] and top.node_size == 2 and top.num_instances == 4
    mixed = node_members([1, 0, 1, 0, 0])
    assert mixed == [(0, [1, 3, 4]), (1, [0, 2])]
    assert mixed.spans is None and mixed.node_size == 0   # gathered, not sliced; uneven
