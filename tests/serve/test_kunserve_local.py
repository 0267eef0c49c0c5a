"""KunServe's control plane driving real in-process engines: overload -> drop -> restore."""

from exactness import TOP, assert_same_run, engine_runs

from tests.engine.test_pipeline import CFG
from tetris.engine.engine import LLMEngine
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams
from tetris.serve.kunserve_local import LocalKunServe, engine_memory

PROMPTS = [list(range(10 + i, 16 + 2 * i)) for i in range(8)]


def _engine(blocks):
    model, _ = load_model(CFG)
    return LLMEngine(model, num_blocks=blocks, block_size=4, max_num_seqs=8)


def _params():
    return SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=TOP)


def test_overload_drops_into_a_pipeline_then_restores_with_the_same_tokens():
    expected = engine_runs(_engine(200), PROMPTS, _params())

    engines = [_engine(10), _engine(10)]          # 40 KV slots each: the batch needs ~130
    ks = LocalKunServe(engines)
    mem = engine_memory(engines[0])
    assert ks.controller.mem == mem
    for i, p in enumerate(PROMPTS):
        engines[i % 2].add_request(f"r{i}", p, _params())
    runs, actions = {f"r{i}": ([], []) for i in range(len(PROMPTS))}, []
    while any(e.has_unfinished() for e in ks.serving()):
        for e in ks.serving():
            for out in e.step():
                runs[out.request_id][0].extend(out.new_token_ids)
                runs[out.request_id][1].extend(out.new_logprobs)
        action = ks.tick()
        if action:
            actions.append(action)
    assert actions == ["drop", "restore"]
    assert not ks.groups and ks.controller.dropped_layers() == {0: 0, 1: 0}
    for i, want in enumerate(expected):      # the pipeline's KV and stages, not just tokens
        assert_same_run(*runs[f"r{i}"], want, f"r{i}")
