"""EMULATION of KunServe: emulated engines take the simulator's pipelined step time, move
sequences between units without recompute, and the wall-clock driver drops and restores
through the control plane's controller. No timing is asserted (the machine is shared)."""

import math

import pytest
from tetris.actors.decode.kunserve_emulated import PipelinedEmulatedEngine

from tetris.bench.kunserve_emulated import KunServeEmulation
from tetris.control.kunserve_memory import InstanceMemory
from tetris.sampling_params import SamplingParams
from tetris.sim.kunserve import KunRequest, PoolProfile, unit_time

BS = 16
# 4 layers whose weights are 3x the KV region: a drop into a pair more than doubles the KV.
MEM = InstanceMemory(num_layers=4, layer_param_bytes=3 * 64 * 4096 // 4, other_param_bytes=4096,
                     kv_bytes=64 * 4096, layer_block_bytes=1024, block_size=BS)
PROF = PoolProfile(name="toy", instances=2, hbm_bytes_per_s=4e9, per_seq_s=1.5e-3,
                   prefill_s_per_token=1e-5, link_bytes_per_s=1e9, pcie_bytes_per_s=1e9,
                   activation_bytes_per_token=64, bubble=0.083, max_batch=64, tick_s=0.05)


def _layers(members):
    return (4,) if len(members) == 1 else (2, 2)


def _engine(members, blocks=64):
    return PipelinedEmulatedEngine(
        members, num_blocks=blocks, block_size=BS, max_batch=8,
        step_model=lambda contexts: unit_time(MEM, PROF, _layers(members), contexts),
        prefill_s_per_token=PROF.prefill_s_per_token, time_scale=2.0)


def _prefilled(engine, rid, prompt, out):
    engine.reserve(rid, [1] * prompt, SamplingParams(max_tokens=out, ignore_eos=True))
    engine.commit_prefilled(rid, 7)


def test_a_step_sleeps_the_simulators_pipelined_iteration():
    slept = []
    pair = _engine((0, 1))
    pair.sleep = slept.append
    for i, n in enumerate((20, 33, 5)):
        _prefilled(pair, str(i), n, 4)
    pair.step()
    contexts = [20 + 1, 33 + 1, 5 + 1]
    model = 2.0 * unit_time(MEM, PROF, (2, 2), contexts)      # time scale 2
    assert pair.emulated_s == pytest.approx(model)
    assert len(slept) == 1 and 0 <= slept[0] <= model      # less the step's own CPU time
    assert unit_time(MEM, PROF, (2, 2), contexts) != unit_time(MEM, PROF, (4,), contexts)


def test_moved_sequences_keep_their_state_and_wait_for_the_exchange():
    slept = []
    src, dst = _engine((0,)), _engine((0, 1), blocks=200)
    src.sleep = dst.sleep = slept.append
    for i, n in enumerate((20, 40)):
        _prefilled(src, str(i), n, 6)
    src.step()
    src.step()
    _prefilled(src, "2", 17, 6)          # committed, not yet scheduled
    src.reserve("3", [1] * 50, SamplingParams(max_tokens=6, ignore_eos=True))   # in prefill
    before = {s.request_id: (list(s.tokens), s.num_computed, len(s.block_table))
              for s in src._seqs.values()}
    taken = src.take()
    assert sorted((s.request_id, n) for s, n in taken) == [(r, before[r][2]) for r in "0123"]
    assert src.blocks.num_free_blocks == 64 and not src._seqs
    moved = [s for s, _ in taken]
    for seq in moved:
        dst.give(seq, ready_at=5.0)
    assert dst.release_held(4.9) == 5.0 and not dst.batcher.ready   # exchange not over
    assert dst.release_held(5.0) is None
    assert sorted(s.request_id for s in dst.batcher.ready) == ["0", "1", "2"]
    for seq in dst._seqs.values():
        tokens, computed, blocks = before[seq.request_id]
        assert (seq.tokens, seq.num_computed, len(seq.block_table)) == (tokens, computed, blocks)
    dst.commit_prefilled("3", 7)          # its prefill lands on the new unit
    finished = {}
    while dst.has_unfinished():
        for out in dst.step():
            if out.finished:
                finished[out.request_id] = len(out.token_ids)
    assert finished == {"0": 6, "1": 6, "2": 6, "3": 6}
    assert all(s.num_preemptions == 0 for s in moved)   # nothing recomputed


def _trace():
    """A burst far over two instances' KV, then a quiet tail (the restore's low usage)."""
    reqs = [KunRequest(i, 0.002 * i, 40 + (i * 37) % 60, 12 + (i * 11) % 20)
            for i in range(60)]
    reqs += [KunRequest(60 + i, 1.0 + 0.15 * i, 30, 60) for i in range(6)]
    return reqs


@pytest.mark.parametrize("policy", ["queue", "recompute", "swap"])
def test_baselines_serve_every_request(policy):
    out = KunServeEmulation(_trace(), MEM, PROF, policy).run()
    assert out["mode"] == "EMULATION" and out["unfinished"] == 0 and out["drops"] == 0
    # queue promises whole outputs up front; the others admit on the prompt and preempt
    assert (out["preemptions"] == 0) == (policy == "queue")


def test_kunserve_drops_under_the_burst_and_restores_after_it():
    reqs = _trace()
    emu = KunServeEmulation(reqs, MEM, PROF, "kunserve")
    out = emu.run()
    assert out["unfinished"] == 0
    assert all(not math.isnan(r.first_token) and r.finish >= r.first_token for r in reqs)
    assert out["drops"] >= 1 and out["restores"] >= 1 and out["exchange_gb"] > 0
    # a replaced unit starts no iteration after the decision: it finishes the one in flight
    assert out["regroup_iterations"] <= 1
    assert len(out["regroup_s"]) == len(out["regroup_landed_s"]) == out["drops"] + out["restores"]
    assert all(d <= landed for d, landed in zip(out["regroup_s"], out["regroup_landed_s"],
                                                 strict=True))
    # tetris:dropped_layers{instance} after each regrouping: a pair drops half the layers
    # each, a restored instance none; the final grouping is undropped again.
    for _, dropped in emu.dropped_layers_log:
        assert set(dropped) == {0, 1} and set(dropped.values()) <= {0, 2}
    assert emu.dropped_layers_log[0][1] == {0: 2, 1: 2}
    assert emu.dropped_layers_log[-1][1] == {0: 0, 1: 0}
    # the pair's engine held invariant 2's capacity: KV plus freed parameter bytes
    assert emu.group_blocks_seen == {(0, 1): MEM.group_kv_blocks([2, 2])}
    assert MEM.group_kv_blocks([2, 2]) > 2 * MEM.kv_blocks
