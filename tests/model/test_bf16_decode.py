"""bf16 decode on CPU: the half-precision paged attention and the engine's greedy tokens.

bf16 results cannot equal transformers' bf16 results bit for bit (different summation orders
round differently), so the reference is the fp32 computation on the same bf16-rounded
weights, and the tolerance is transformers' own bf16 error against it: the engine in bf16
must be about as close to fp32 as transformers in bf16 is.
"""

from __future__ import annotations

import math

import pytest
import torch

from tetris.config import ModelConfig
import tetris.engine.engine as engine_module
from tetris.engine.engine import LLMEngine
from tetris.engine.sampling import draw, process_logits, sample
from tetris.kernels.paged_decode import paged_decode_attention
from tetris.model.hf_config import model_config_from_hf
from tetris.model.llama import LlamaModel
from tetris.model.loader import load_model
from tetris.model.weights import load_hf_weights
from tetris.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)
NEW_TOKENS = 12
PROMPT_LEN = 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    # std 0.02 weights give a near-uniform next-token distribution; wider ones make the
    # greedy choice depend on the model rather than on rounding.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("bf16") / "llama"
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def _hf(path, dtype):
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _ours(path):
    cfg = model_config_from_hf(path, ModelConfig(source="hf", path=str(path), dtype="bfloat16"))
    model = LlamaModel(cfg)
    load_hf_weights(model, path)
    return model.eval()


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, LLAMA["vocab_size"], (3, PROMPT_LEN), generator=gen)


@pytest.fixture(scope="module")
def greedy(checkpoint, prompts):
    """Greedy continuations: the engine in bf16 (packed bf16 GEMMs, paged bf16 attention,
    all three prompts in one batch) and transformers in bf16 (one batch, no padding)."""
    engine = LLMEngine(_ours(checkpoint), None, num_blocks=32, block_size=8, max_num_seqs=4)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ours = [list(o.token_ids) for o in engine.generate(prompts.tolist(), params)]
    with torch.inference_mode():
        out = _hf(checkpoint, torch.bfloat16).generate(
            prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return ours, out[:, PROMPT_LEN:].tolist()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits.float()


def test_engine_bf16_tokens_are_fp32_greedy_within_bf16_error(checkpoint, prompts, greedy):
    """Every token the bf16 engine picks is within transformers' bf16 logit error of the fp32
    argmax, given the same context (teacher forcing through the fp32 model)."""
    ours, _ = greedy
    ids = torch.cat([prompts, torch.tensor(ours)], dim=1)
    ref = _logits(_hf(checkpoint, torch.float32), ids)[:, PROMPT_LEN - 1:-1]  # [B, N, V]
    hf_error = (_logits(_hf(checkpoint, torch.bfloat16), ids)[:, PROMPT_LEN - 1:-1] - ref).abs()
    margin = 2 * float(hf_error.max())
    # The margin must be small next to the logits' spread, or the check would say nothing.
    assert margin < 0.1 * float(ref.std(dim=-1).mean())
    picked = ref.gather(-1, torch.tensor(ours)[..., None])[..., 0]
    shortfall = ref.amax(dim=-1) - picked
    assert float(shortfall.max()) <= margin, shortfall


def test_engine_bf16_greedy_agrees_with_transformers_bf16(greedy):
    """With logits this spread out, rounding flips no choice: the sequences are identical."""
    ours, hf = greedy
    assert ours == hf


def test_engine_bf16_prefill_logits_close_to_transformers(checkpoint, prompts):
    model = _ours(checkpoint)
    model.pack_weights(batch_hint=4)
    ref = _logits(_hf(checkpoint, torch.float32), prompts)[:, -1]
    hf16 = _logits(_hf(checkpoint, torch.bfloat16), prompts)[:, -1]
    engine = LLMEngine(model, None, num_blocks=16, block_size=8, max_num_seqs=4,
                       packed_weights=False)  # already packed above
    assert model.head_packed is not None
    engine.add_request("0", prompts[0].tolist(), SamplingParams(max_tokens=1, temperature=0.0))
    plan = engine.batcher.schedule()
    logits, _ = engine.runner.execute(plan)
    # A greedy-only batch keeps the model's dtype (its argmax is the fp32 one).
    assert logits.dtype == torch.bfloat16 and logits.shape == (1, LLAMA["vocab_size"])
    ours_error = float((logits[0].float() - ref[0]).abs().max())
    assert ours_error <= 2 * float((hf16[0] - ref[0]).abs().max()) + 1e-3


def _paged(dtype, lens, seed=0, hq=6, hkv=2, d=32, bs=4, nb=32):
    gen = torch.Generator().manual_seed(seed)
    b = len(lens)
    q = torch.randn(b, hq, d, generator=gen).to(dtype)
    kc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    maxb = max(1, -(-max(lens) // bs))
    tables = torch.randperm(nb, generator=gen)[:b * maxb].view(b, maxb).to(torch.int32)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32)


def _explicit(q, kc, vc, tables, lens):
    """Per-row softmax(q k^T / sqrt(D)) v in fp64 over exactly the row's context."""
    b, hq, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    for row in range(b):
        n = int(lens[row])
        if n == 0:
            continue
        slots = torch.arange(n)
        blocks = tables[row, slots // bs].long()
        k = kc[blocks, slots % bs].double().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = vc[blocks, slots % bs].double().repeat_interleave(hq // hkv, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[row].double(), k) / math.sqrt(d), -1)
        out[row] = torch.einsum("hn,nhd->hd", w, v)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_paged_decode_attention_matches_explicit_softmax(dtype):
    lens = [1, 9, 0, 17, 4]
    q, kc, vc, tables, context = _paged(dtype, lens)
    got = paged_decode_attention(q, kc, vc, tables, context)
    assert got.dtype == dtype
    want = _explicit(q, kc, vc, tables, context)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # an empty context attends to nothing
    # Three roundings to the half dtype (scores, probabilities, output), each relative
    # 2^-8 (bf16) or 2^-11 (fp16), on outputs of magnitude about 1 and scores up to ~10
    # (an error of 10 * 2^-8 = 0.04 in a score moves its weight by 4%).
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    # The error is rounding, not a wrong mask: a context one token longer is far off.
    longer = _explicit(q, kc, vc, tables, context + torch.tensor([1, 1, 0, 1, 1]))
    assert float((got.double() - longer).abs().max()) > 5 * tol


def test_half_paged_decode_attention_close_to_fp32_path():
    """The bf16 path against the fp32 path on the same (bf16-valued) inputs."""
    q, kc, vc, tables, context = _paged(torch.bfloat16, [7, 12, 3], seed=4)
    got = paged_decode_attention(q, kc, vc, tables, context).float()
    fp32 = paged_decode_attention(q.float(), kc.float(), vc.float(), tables, context)
    assert float((got - fp32).abs().max()) < 5e-2


def _tied_head_model():
    """A bf16 model whose LM head has 5 distinct rows: logits take few values, so rows hold
    tied maxima, several blocks of ``greedy_tokens`` apart (vocab 1024: 4 blocks of 256)."""
    cfg = ModelConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=128, seed=11,
                      dtype="bfloat16")
    model, _ = load_model(cfg)
    head = model.lm_head.weight
    base = head[:5].clone()
    base[4] = -base[0]  # base[0] or its negation scores above 0: the max is on a tied row
    with torch.no_grad():
        head.zero_()
        head[300:] = base[torch.arange(300, cfg.vocab_size) % 5]
    return model


def _recording_sample(monkeypatch):
    """Patch the engine's sampler to record (logits, params, (seed, position) keys, tokens)."""
    calls = []

    def spy(logits, seqs):
        states = [(s.seed, s.num_tokens) for s in seqs]   # what a seeded draw is keyed by
        tokens = sample(logits, seqs)
        calls.append((logits.clone(), [s.params for s in seqs], states, tokens))
        return tokens

    monkeypatch.setattr(engine_module, "sample", spy)
    return calls


def test_bf16_greedy_tokens_are_fp32_argmax_of_the_same_logits_ties_included(monkeypatch):
    calls = _recording_sample(monkeypatch)
    engine = LLMEngine(_tied_head_model(), None, num_blocks=32, block_size=8, max_num_seqs=4)
    prompts = [[5, 9, 200, 31, 7], [44, 3, 17], [900, 12, 650, 8, 8, 71]]
    engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    tied_rows = later_block_ties = 0
    for logits, _, _, tokens in calls:
        assert logits.dtype == torch.bfloat16  # all greedy: no fp32 copy was made
        wide = logits.float()
        assert tokens == wide.argmax(dim=-1).tolist()
        is_max = wide == wide.amax(dim=-1, keepdim=True)
        tied_rows += int((is_max.sum(-1) > 1).sum())
        later_block_ties += int(is_max[:, 512:].any(-1).sum())
    # The check only means something if the rows really tie, across blocks.
    assert tied_rows == later_block_ties == sum(len(c[3]) for c in calls) > 0


def test_bf16_mixed_batch_samples_from_fp32_logits(monkeypatch):
    """One greedy and one random request share the batch: the logits come as fp32, and the
    random row draws what its (seed, position) draws from those fp32 logits."""
    calls = _recording_sample(monkeypatch)
    engine = LLMEngine(_tied_head_model(), None, num_blocks=32, block_size=8, max_num_seqs=4)
    engine.generate([[5, 9, 200, 31], [44, 3, 17, 600]],
                    [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                     SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True)])
    mixed = [c for c in calls if len({p.greedy for p in c[1]}) == 2]
    assert len(mixed) >= 4
    for logits, params, states, tokens in mixed:
        assert logits.dtype == torch.float32
        for row, (p, state) in enumerate(zip(params, states, strict=True)):
            if p.greedy:
                assert tokens[row] == int(logits[row].argmax())
                continue
            seed, position = state
            assert tokens[row] == draw(process_logits(logits[row], p), seed, position)
