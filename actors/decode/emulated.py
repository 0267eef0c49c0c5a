"""EMULATION: a decode engine with no model and no KV tensors, for the paper-scale emulated cluster.

``EmulatedDecodeEngine`` keeps ``LLMEngine``'s decode-side contract (``can_reserve``,
``reserve``, ``commit_prefilled``, ``abort_request``, ``step``, ``stats``) and its real
bookkeeping: the same ``Batcher`` (continuous batching, admission, preemption) over the same
``BlockManager`` at the deployment's KV capacity. A step sleeps what the decode latency model
(``scheduler/decode_latency.py``) gives for (TP size, batch, KV tokens of the batch), times the
emulation's time scale, and appends ``PLACEHOLDER_TOKEN`` to every running sequence: never EOS,
so requests end by ``max_tokens``, as the simulator assumes.

KV streaming keeps its control plane: the receive manager runs over ``cache``, meta tensors of
the wire geometry (``WIRE_HEAD_DIM`` = 1, the model's dtype and KV heads) that hold no memory.
The emulated prefill worker sends that same geometry, and the emulated transfer backend times
each write at ``emulated_bytes_per_wire_byte`` (the model's head_dim) paper bytes per wire byte.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from tetris.config import DeploymentConfig, ModelConfig
from tetris.engine.batcher import Batcher
from tetris.engine.block_manager import BlockManager
from tetris.engine.engine import LLMEngine
from tetris.engine.request import RequestOutput, Sequence
from tetris.sampling_params import SamplingParams
from tetris.scheduler.decode_latency import DecodeLatencyModel, DecodeModelSpec

__all__ = ["EmulatedDecodeEngine", "EmulatedCache", "PLACEHOLDER_TOKEN", "WIRE_HEAD_DIM",
           "decode_model_spec", "torch_dtype"]

PLACEHOLDER_TOKEN = 120    # what emulated prefill and decode emit ("x" for the byte tokenizer)
WIRE_HEAD_DIM = 1          # head_dim of emulated KV on the wire: control plane real, payload tiny


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "auto": torch.float32}[name]   # "auto": emulated actors hold no GPU tensors


def decode_model_spec(model: ModelConfig) -> DecodeModelSpec:
    """Weight and KV bytes of a Llama geometry, for the decode latency model.

    Weights: embeddings (twice unless tied), per layer q/o (H·H each), k/v (H·Hkv·D each) and
    the MLP (3·H·I), plus norms; LLaMA3-8B gives 8.03e9 parameters, as ``LLAMA3_8B`` states.
    """
    h, d = model.hidden_size, model.attention_head_dim
    q_dim, kv_dim = model.num_heads * d, model.num_kv_heads * d
    per_layer = h * q_dim * 2 + h * kv_dim * 2 + 3 * h * model.intermediate_size + 2 * h
    embed = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    elt = torch.empty((), dtype=torch_dtype(model.dtype)).element_size()
    params = embed + model.num_layers * per_layer + h
    kv = 2 * model.num_layers * model.num_kv_heads * d * elt
    return DecodeModelSpec(model.name, float(params * elt), float(kv), model.num_layers, h)


class EmulatedCache:
    """What the receive manager needs of ``KVCache``: per layer ``k[i]``, ``v[i]``, here meta
    tensors ``[num_blocks, block_size, kv_heads, WIRE_HEAD_DIM]`` (no storage)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 dtype: torch.dtype) -> None:
        shape = (num_blocks, block_size, kv_heads, WIRE_HEAD_DIM)
        self.num_layers = num_layers
        self.k = [torch.empty(shape, dtype=dtype, device="meta") for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device="meta") for _ in range(num_layers)]


class EmulatedDecodeEngine(LLMEngine):
    """One decode instance's engine in emulation; ``tp_size`` is the instance's (paper) TP.

    The request bookkeeping, batching, blocks, stop checks and stats are ``LLMEngine``'s own;
    only the forward pass (``_execute``) is replaced: it sleeps the decode latency model's time
    and samples ``PLACEHOLDER_TOKEN``. There is no model, no tokenizer and no EOS.
    """

    def __init__(self, deployment: DeploymentConfig, *, tp_size: int, kv_heads: int,
                 time_scale: float = 1.0, sleep: Callable[[float], None] = time.sleep) -> None:
        dc, mc = deployment.decode, deployment.model
        self.tp_size = tp_size
        self.time_scale = time_scale
        self.sleep = sleep
        self.latency = DecodeLatencyModel(decode_model_spec(mc))
        self.model = None
        self.runner = None
        self.tokenizer = None
        self.max_model_len = mc.max_position_embeddings
        self.vocab_size = mc.vocab_size
        self.blocks = BlockManager(dc.kv_blocks, dc.block_size)
        self._usable_blocks = dc.kv_blocks
        # A re-admitted (preempted) sequence is "recomputed" in one step: no token budget.
        self.batcher = Batcher(self.blocks, max_num_seqs=dc.max_batch_size,
                               max_num_batched_tokens=dc.kv_blocks * dc.block_size)
        self.cache = EmulatedCache(mc.num_layers, dc.kv_blocks, dc.block_size, kv_heads,
                                   torch_dtype(mc.dtype))
        self._rng = random.Random(0)
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self._eos = frozenset()     # placeholders never end a request early
        self.emulated_s = 0.0       # emulated step time slept so far (time-scaled)

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        raise ValueError("an emulated decode instance does not prefill: its prompts come "
                         "from the prefill pool (reserve, then commit_prefilled)")

    # -- one iteration ----------------------------------------------------------------------
    def _execute(self, plan) -> tuple[list[Sequence], list[int]]:
        """Wait the emulated step time of the scheduled batch; placeholders for the samplers."""
        scheduled = plan.decodes + plan.prefills
        context = sum(s.seq.num_tokens for s in scheduled)
        seconds = self.latency.step_time(self.tp_size, len(scheduled), context) * self.time_scale
        self.sleep(seconds)
        self.emulated_s += seconds
        sampling = [s.seq for s in scheduled if s.samples]   # read before num_computed moves on
        for sched in scheduled:
            sched.seq.num_computed += sched.num_new_tokens
        return sampling, [PLACEHOLDER_TOKEN] * len(sampling)
