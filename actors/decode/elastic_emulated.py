"""EMULATION of elastic decode: emulated decode engines that exchange real q and partials.

``EmulatedElasticEngine`` is the emulated decode engine (``emulated.py``: real batching and
blocks, steps that sleep the decode latency model's time) taking part in an elastic world
through ``EmulatedElasticRows``, the live ``ElasticRows`` protocol (headers, per-layer
exchanges over the same peer link) with tensors of the paper model's geometry and no
attention computed. One actor stands for a whole TP group, so the tensors are one TP rank's
head slice (the ranks' exchanges run side by side on their own links).

A step, per layer: sleep the layer's share of the step time, then the layer's two exchanges.
The step time is the decode latency model's for the instance's batch over the KV it reads:
its sequences' own tokens (a master's from ``kv_start`` only) plus the ranges it holds for
masters that ask this round (the holder reads them, CSPS Fig. 13). So a master's round waits,
layer by layer, for its slowest holder, and the exchanges cost what they cost on this
machine's link.
"""

from __future__ import annotations

import torch
from tetris.actors.decode.emulated import (
    PLACEHOLDER_TOKEN,
    EmulatedDecodeEngine,
    torch_dtype,
)

from tetris.engine.elastic_rows import ElasticRows

__all__ = ["EmulatedElasticEngine", "EmulatedElasticRows", "make_elastic"]


class EmulatedElasticRows(ElasticRows):
    """``ElasticRows`` on an emulated engine: the paper geometry's q and partials, no math."""

    def _attach(self, engine) -> None:
        if getattr(engine, "elastic", None) is not None:
            raise ValueError("this engine already takes part in an elastic world")
        mc = engine.deployment.model
        tp = engine.tp_size
        if mc.num_heads % tp:
            raise ValueError(f"{mc.num_heads} heads cannot be split over TP {tp}")
        self._geometry = (mc.num_heads // tp, mc.attention_head_dim)
        self._wire_dtype = torch_dtype(mc.dtype)
        engine.elastic = self

    def _heads(self) -> tuple[int, int]:
        return self._geometry

    def _dtype(self, layer: int) -> torch.dtype:
        return self._wire_dtype

    def _partial(self, layer: int, q: torch.Tensor, rows):
        heads = q.shape[1]
        return torch.zeros_like(q), torch.zeros(heads, q.shape[0], dtype=torch.float32)

    def answered_tokens(self) -> int:
        """KV tokens of the ranges this instance reads for other masters this round."""
        step = self._step
        return 0 if step is None else sum(s.num_tokens for rows in step.answers.values()
                                          for shards in rows for s in shards)

    def layer(self, layer: int) -> None:
        """This layer's exchanges: placeholder q for the rows asked about, answers back."""
        step = self._step
        heads, dim = self._geometry
        self._answer(layer, step, {p: [torch.zeros(len(rows), heads, dim,
                                                   dtype=self._wire_dtype)]
                                   for p, rows in step.asks.items()})

    def idle_step(self) -> None:
        """No batch of its own: still the layers' time to read what it is asked about."""
        if self._step is None:
            self.begin([])
        self.engine.sleep_layers(0, self.answered_tokens(), self)
        self._step = None


class EmulatedElasticEngine(EmulatedDecodeEngine):
    """An emulated decode engine in an elastic world (``EmulatedElasticRows(engine, ...)``)."""

    elastic: EmulatedElasticRows | None = None

    def __init__(self, deployment, **kw) -> None:
        super().__init__(deployment, **kw)
        self.deployment = deployment

    def sleep_layers(self, batch: int, context: int, rows: EmulatedElasticRows) -> float:
        """Sleep a step of ``batch`` rows over ``context`` KV tokens, layer by layer, with
        each layer's exchanges after its share. Returns the slept seconds."""
        seconds = self.latency.step_time(self.tp_size, max(batch, 1), context)
        if batch == 0:   # a holder alone: only the KV it reads (weights stay unread)
            seconds -= self.latency.step_time(self.tp_size, 1, 0)
        seconds *= self.time_scale
        layers = self.cache.num_layers
        for layer in range(layers):
            self.sleep(seconds / layers)
            rows.layer(layer)
        self.emulated_s += seconds
        return seconds

    def _execute(self, plan):
        rows = self.elastic
        if rows is None:
            return super()._execute(plan)
        scheduled = plan.decodes + plan.prefills
        rows.begin([s.seq for s in plan.decodes])
        own = sum(s.seq.num_tokens - s.seq.kv_start for s in scheduled)
        self.sleep_layers(len(scheduled), own + rows.answered_tokens(), rows)
        sampling = [s.seq for s in scheduled if s.samples]
        for sched in scheduled:
            sched.seq.num_computed += sched.num_new_tokens
        return sampling, [PLACEHOLDER_TOKEN] * len(sampling)


def make_elastic(engine: EmulatedDecodeEngine, deployment) -> EmulatedElasticEngine:
    """The emulated engine a decode rank built, made the elastic one in place (the served
    path: ``ElasticMember`` on an emulated rank). ``EmulatedElasticEngine`` adds methods and
    the two attributes set here, no other state, so the engine's requests and blocks stay."""
    if not isinstance(engine, EmulatedElasticEngine):
        engine.__class__ = EmulatedElasticEngine
        engine.elastic = None
    engine.deployment = deployment
    return engine
