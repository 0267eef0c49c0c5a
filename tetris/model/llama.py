"""The Llama-3 family (Llama 2/3/3.1-style decoders) with a pluggable attention op.

One layer, in the flat token layout (T tokens, H hidden, per-rank heads Hq_l / Hkv_l, D):

    q, k, v = layer_qkv(i, hidden, positions)      # RMSNorm, projections, RoPE
    attn    = attention(i, q, k, v)                # [T, Hq_l, D]: supplied by the caller
    hidden  = layer_attn_out(i, hidden, attn)      # o_proj (+ TP all-reduce) + residual
    hidden  = layer_mlp(i, hidden)                 # RMSNorm, SwiGLU (+ TP all-reduce) + residual

The attention op is what differs between callers: causal attention over the sequence itself
(tests, the oracle), paged-cache attention (the engine), ring attention over an SP group
(prefill workers). The model holds no KV cache: the op owns it, since it knows the layout.

Tensor parallelism splits heads and the MLP's intermediate features over ``tp_group``; the
embedding, norms and LM head are replicated on every rank (their memory is small next to the
layers for the models served here, and it saves a gather per step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tetris.config import ModelConfig
from tetris.device import dtype_for_device
from tetris.model.layers import RMSNorm, RotaryEmbedding
from tetris.model.packed import PackedWeight, can_pack, linear
from tetris.model.parallel import ColumnParallelLinear, RowParallelLinear, tp_rank_size

__all__ = ["LlamaModel", "AttentionOp", "torch_dtype"]

AttentionOp = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":   # the CPU's default; a model on CUDA takes bfloat16 (tetris/device.py)
        return torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


class _Fused:
    """Column-parallel linears whose local weights are row ranges of one [sum out, in] tensor.

    The member linears keep their own parameters (HF names, loading, TP sharding unchanged),
    but each parameter is a view into the shared tensor, so one GEMM computes all their
    outputs side by side. If anything re-materialises a member's weight (``module.to``, a
    replaced parameter), the views stop aliasing and ``__call__`` falls back to one GEMM per
    member, so results never use stale weights.
    """

    def __init__(self, linears: list[ColumnParallelLinear]) -> None:
        first = linears[0].weight
        rows = [lin.weight.shape[0] for lin in linears]
        self.weight = torch.empty(sum(rows), first.shape[1], dtype=first.dtype,
                                  device=first.device)
        self.linears = linears
        self.sizes = rows
        self.packed: PackedWeight | None = None
        start = 0
        for lin, n in zip(linears, rows, strict=True):
            lin.weight = torch.nn.Parameter(self.weight[start:start + n], requires_grad=False)
            start += n

    def aliased(self) -> bool:
        base = self.weight.data_ptr()
        offsets, start = [], 0
        for n in self.sizes:
            offsets.append(base + start * self.weight.stride(0) * self.weight.element_size())
            start += n
        return all(lin.weight.data_ptr() == off and lin.weight.device == self.weight.device
                   for lin, off in zip(self.linears, offsets, strict=True))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, sum out]
        if self.aliased():
            return linear(x, self.weight, self.packed)
        return torch.cat([lin(x) for lin in self.linears], dim=-1)


class _Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group, dtype, device):
        super().__init__()
        d = cfg.attention_head_dim
        h = cfg.hidden_size
        kw = dict(tp_group=tp_group, dtype=dtype, device=device)
        self.q_proj = ColumnParallelLinear(h, cfg.num_heads * d, what="num_heads * head_dim", **kw)
        self.k_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d,
                                           what="num_kv_heads * head_dim", **kw)
        self.v_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d,
                                           what="num_kv_heads * head_dim", **kw)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, h, what="num_heads * head_dim", **kw)
        self.qkv = _Fused([self.q_proj, self.k_proj, self.v_proj])


class _MLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group, dtype, device):
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        kw = dict(tp_group=tp_group, dtype=dtype, device=device, what="intermediate_size")
        self.gate_proj = ColumnParallelLinear(h, f, **kw)
        self.up_proj = ColumnParallelLinear(h, f, **kw)
        self.down_proj = RowParallelLinear(f, h, **kw)
        self.gate_up = _Fused([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate, up = self.gate_up(x).split(self.gate_up.sizes, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class _DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype,
                                       device=device)
        self.self_attn = _Attention(cfg, tp_group, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype,
                                                device=device)
        self.mlp = _MLP(cfg, tp_group, dtype, device)


class LlamaModel(torch.nn.Module):
    """Llama decoder; parameter names follow HF ``LlamaForCausalLM`` without ``model.``.

    Weights are uninitialised after construction: use ``tetris.model.loader.load_model``
    (or ``tetris.model.weights``) to fill them.
    """

    def __init__(self, cfg: ModelConfig, *, tp_group=None, dtype=None, device="cpu"):
        super().__init__()
        self.cfg = cfg
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = tp_rank_size(tp_group)
        for what, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads)):
            if n % self.tp_size:
                raise ValueError(
                    f"model.{what} ({n}) is not divisible by the tensor-parallel size "
                    f"{self.tp_size}: heads are split across ranks and KV heads are not replicated"
                )
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype if dtype is not None
                                 else dtype_for_device(cfg.dtype, self.device.type))
        self.num_layers = cfg.num_layers
        self.head_dim = cfg.attention_head_dim
        self.local_num_heads = cfg.num_heads // self.tp_size
        self.local_num_kv_heads = cfg.num_kv_heads // self.tp_size
        kw = dict(dtype=self.dtype, device=self.device)
        self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, **kw)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = torch.nn.ModuleList(
            _DecoderLayer(cfg, tp_group, self.dtype, self.device) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, **kw)
            self.lm_head.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(self.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                      device=self.device)
        self.requires_grad_(False)
        self.head_packed: PackedWeight | None = None

    # ---- packed CPU weights ----

    def _packable(self) -> list[tuple[object, torch.Tensor]]:
        """(holder, weight) of every GEMM of a pass: the holder's ``packed`` serves it."""
        out: list[tuple[object, torch.Tensor]] = []
        for layer in self.layers:
            out.append((layer.self_attn.qkv, layer.self_attn.qkv.weight))
            out.append((layer.self_attn.o_proj, layer.self_attn.o_proj.weight))
            out.append((layer.mlp.gate_up, layer.mlp.gate_up.weight))
            out.append((layer.mlp.down_proj, layer.mlp.down_proj.weight))
        return out

    def pack_weights(self, batch_hint: int = 32) -> int:
        """Give every GEMM weight a oneDNN-packed copy (``tetris.model.packed``); returns how
        many copies were made (0 where packing is unavailable, e.g. off CPU).

        Call after the weights are loaded. A weight changed afterwards (in place or replaced)
        is noticed and served by ``F.linear`` again until the next call. The copies double
        the memory of the weights.
        """
        made = 0
        for holder, weight in self._packable():
            if not can_pack(weight):
                continue
            if holder.packed is None or not holder.packed.fresh_for(weight):
                holder.packed = PackedWeight(weight, batch_hint)
                made += 1
        head = self._head_weight()
        if can_pack(head) and (self.head_packed is None or not self.head_packed.fresh_for(head)):
            self.head_packed = PackedWeight(head, batch_hint)
            made += 1
        return made

    def unpack_weights(self) -> None:
        """Drop the packed copies: every GEMM goes back to ``F.linear``."""
        for holder, _ in self._packable():
            holder.packed = None
        self.head_packed = None

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    # ---- per-layer steps (the pieces ring attention and the engine interleave) ----

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids LongTensor[T] -> [T, H]."""
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be a flat [T] tensor, got {tuple(input_ids.shape)}")
        return self.embed_tokens(input_ids.to(self.device))

    def layer_qkv(self, i: int, hidden: torch.Tensor, positions: torch.Tensor):
        """hidden [T, H], positions LongTensor[T] -> q [T, Hq_l, D], k, v [T, Hkv_l, D]."""
        t = hidden.shape[0]
        if positions.shape != (t,):
            raise ValueError(f"positions must be [T]={t}, got {tuple(positions.shape)}")
        q, k, v = self._qkv(i, hidden, self.rotary.cos_sin(positions, hidden.dtype))
        return q.contiguous(), k.contiguous(), v.contiguous()

    def _qkv(self, i: int, hidden: torch.Tensor, cos_sin):
        """``layer_qkv`` with the rotary tables of this pass already computed.

        q, k and v are views into shared buffers (token rows hq+hkv or hq+2hkv heads apart):
        every head's D values are contiguous, which is all the attention ops need.
        """
        layer = self.layers[i]
        t = hidden.shape[0]
        hq, hkv, d = self.local_num_heads, self.local_num_kv_heads, self.head_dim
        qkv = layer.self_attn.qkv(layer.input_layernorm(hidden))  # [T, (Hq_l + 2 Hkv_l) D]
        cos, sin = cos_sin
        # q and k rotate by the same per-token angles: one pass over both.
        qk = RotaryEmbedding.rotate(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
        return qk[:, :hq], qk[:, hq:], qkv[:, (hq + hkv) * d:].view(t, hkv, d)

    def layer_attn_out(self, i: int, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """residual [T, H], attn [T, Hq_l, D] -> residual + o_proj(attn) [T, H]."""
        t = residual.shape[0]
        if attn.shape != (t, self.local_num_heads, self.head_dim):
            raise ValueError(
                f"attention output must be [T, Hq_l, D] = {(t, self.local_num_heads, self.head_dim)}"
                f", got {tuple(attn.shape)}"
            )
        out = self.layers[i].self_attn.o_proj(attn.reshape(t, -1).to(residual.dtype))
        return residual + out

    def layer_mlp(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> hidden + SwiGLU(RMSNorm(hidden)) [T, H]."""
        layer = self.layers[i]
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last RMSNorm, [T, H] -> [T, H] (``forward`` applies it already)."""
        return self.norm(hidden)

    # ---- whole passes ----

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: AttentionOp) -> torch.Tensor:
        """Run every layer; returns the final-normed hidden states [T, H]."""
        hidden = self.embed(input_ids)
        positions = positions.to(self.device)
        if positions.shape != (hidden.shape[0],):
            raise ValueError(f"positions must be [T]={hidden.shape[0]}, got {tuple(positions.shape)}")
        cos_sin = self.rotary.cos_sin(positions, hidden.dtype)  # shared by every layer
        for i in range(self.num_layers):
            q, k, v = self._qkv(i, hidden, cos_sin)
            hidden = self.layer_attn_out(i, hidden, attention(i, q, k, v))
            hidden = self.layer_mlp(i, hidden)
        return self.final_norm(hidden)

    def logits(self, hidden: torch.Tensor, *, upcast: bool = True) -> torch.Tensor:
        """Final-normed hidden [N, H] -> logits [N, V] (full vocab on every rank): float32, or
        the weights' dtype with ``upcast=False`` (enough for an argmax: see engine.sampling)."""
        weight = self._head_weight()
        out = linear(hidden.to(weight.dtype), weight, self.head_packed)
        return out.float() if upcast else out
