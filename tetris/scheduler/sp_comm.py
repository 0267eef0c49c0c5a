"""Communication cost of a chunk's SP layout, and the per-chunk choice (CSPS §3.2.2, Appendix A).

A chunk of ``l`` tokens after ``h`` history tokens on a group of ``N`` instances moves, per
layer (elements summed over the group; ``Hq``, ``Hkv`` heads of ``d_h``, ``d = Hq·d_h``):

    ring (zigzag ring attention): every member forwards N−1 KV blocks of (h+l)/N tokens
        V_ring = (N−1)·(h+l)·2·Hkv·d_h
    a2a (SP-NTP, Ulysses; actors/prefill/alltoall.py): A2A #1 carries queries of the chunk and
    K, V of the chunk and its history, A2A #2 the outputs; a member keeps 1/N of each
        V_a2a = (N−1)/N · (2·l·Hq·d_h + 2·(h+l)·R·d_h),  R = max(Hkv, N)
        (R = Hkv when N divides the KV heads; past Hkv each KV head goes to N/Hkv members)
        (Appendix A's 4·L_in·d·(N−1)/N at h = 0 with MHA; GQA per csps-notes §2.1 [RECON])
    all-gather (SP-TP, Megatron-SP; Appendix A, chunk only)
        V_ag = 2·l·d·(N−1)
    sptp (SP-TP as executed, actors/prefill/sptp.py): the all-gather of the members' hidden
    rows and the reduce-scatter of the o_proj partials, plus each member's history KV of the
    KV heads every other member reads (``R = max(Hkv, N)`` KV heads over the shards: a KV head
    is replicated on N/Hkv members when N > Hkv)
        V_sptp = 2·l·d·(N−1) + (N−1)/N · h·2·R·d_h
    (flat; a group spanning nodes runs the hierarchical collectives of sptp_hier.py, which
    cross each node pair once: its time is three steps per collective, ``_hierarchical``;
    the history KV goes directly, charged before them)
    sptp on TP > 1 instances (T ranks each; the geometry is per instance, ``per_instance``):
    SP-TP runs per head slice between the TP ranks t of the members (sptp.py), and every
    slice gathers and reduces the whole ``d``-wide rows: ``d`` is the model's
    (``ModelGeometry.model_hidden``), not the slice's ``Hq/T·d_h``, while the history KV is
    the slice's. The instance's all-reduce of the reduced rows (``n_r·d``) is the one its
    row-parallel ``o_proj`` makes under the ring, on the same rows: not a cost of the layout.
    So SP-TP's volume per slice is the TP-1 one and the ring's is 1/T of it: TP makes SP-TP
    relatively dearer, as the paper finds (SP-NTP 23–35% above SP-TP).
    SP-NTP on a TP deployment (Appendix A): members hold 1/N of the attention weights and
    must all-gather them first, ``4·d²·(N−1)`` per layer (``LayoutChooser(ntp_gathers_weights)``).
    Against SP-TP at h = 0 with MHA, SP-NTP then wins iff L > 2dN/(N−2): never at N = 2 (the
    paper's text says "always" there; its own formula says never: an erratum, notes §1.4).

At h = 0 and equal bandwidths SP-NTP beats the ring iff l·Hq < (h+l)·Hkv·(N−1): for LLaMA3-8B
(Hq/Hkv = 4) from N = 5 on at any h, at N = 2 once h > 3l.

Times: a ring step is as slow as its slowest hop (the inter-node one when the group spans
nodes), N−1 steps per layer. An all-to-all runs its intra- and inter-node sends at once, so it
takes the longer of the two, for the member with the most of the slower kind. Each message costs
``message_latency_s`` once. The ring overlaps each step's transfer with attention on the block
it holds, so only the excess is exposed: ``max(0, transfer − attention_s / (layers·N))`` per
step, with ``attention_s`` the chunk's attention time (Eq. 1's quadratic terms,
``γ·h·l + δ·l²``; 0 charges the ring in full). The unpipelined all-to-all's time is all
exposed. Eq. 1 was fitted on ring runs, so its coefficients already hold the ring's exposed
communication *on the links the profile ran on* (``fit_links``, ``[sp_layout] fit_*_gbps``),
not the deployment's: a chunk on layout X (the ring included) is predicted at
``T_s(h, l) − T_ring(fit) + T_X(deployment)``, the ring's hiding behind attention the same on
both sides. ``T_s − T_ring(fit)`` is the chunk's compute, which no link changes, so a slower
link never makes a chunk faster (before, ``T_ring`` was priced at the deployment's links, and
a NIC slower than the profile's made non-ring chunks faster, even negative).

Pipelined layouts (``pipelined_time``, opt-in ``LayoutChooser(micro_partitions)``): ``a2a/M``,
CSPS's three-phase pipeline (actors/prefill/alltoall_pipeline.py), and ``ring/M``, the ring's
blocks in pieces (ring_pipeline.py), priced by sp_pipeline.py: piece m+1's transfer behind
piece m's attention, the first piece's not hidden, ``piece_overhead_s`` (default the message
latency) per extra piece per exchange. The chooser takes the cheapest of every layout and
``x/M``; ``sptp`` has no pipelined executor (Fig. 9b is not built).

Pure: no torch, no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from tetris.scheduler.sp_pipeline import exposed_a2a_s, exposed_ring_s

__all__ = [
    "LLAMA3_8B",
    "LLAMA3_70B",
    "CommLinks",
    "LayoutChoice",
    "LayoutChooser",
    "ModelGeometry",
    "layout_time",
    "layout_volume",
    "pipelined_time",
]


class ModelGeometry(NamedTuple):
    """What the volumes need of a model, per instance (KV heads after TP)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tp_size: int = 1   # the instance's TP ranks: heads above are one rank's slice

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def model_hidden(self) -> int:
        """The model's hidden width ``d``: the rows SP-TP gathers on every head slice."""
        return self.hidden * self.tp_size

    def per_instance(self, tp_size: int) -> ModelGeometry:
        """An instance of ``tp_size`` GPUs holds 1/tp of the heads (its own all-to-all)."""
        return self._replace(num_heads=self.num_heads // tp_size,
                             num_kv_heads=self.num_kv_heads // tp_size,
                             tp_size=self.tp_size * tp_size)

    @classmethod
    def from_model_config(cls, model, tp_size: int = 1) -> ModelGeometry:
        head_dim = model.head_dim or model.hidden_size // model.num_heads
        return cls(model.num_layers, model.num_heads // tp_size,
                   model.num_kv_heads // tp_size, head_dim, tp_size)


# The paper's models (Tetris §7.1, CSPS §3.1); the simulator's clusters run 8B at TP 1 and
# 70B at TP 4 (``per_instance``).
LLAMA3_8B = ModelGeometry(num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)
LLAMA3_70B = ModelGeometry(num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128)


class CommLinks(NamedTuple):
    """Per-instance bandwidths in bytes/s, one message's latency, bytes per element."""

    intra_node: float
    inter_node: float
    message_latency_s: float = 10e-6
    bytes_per_element: int = 2

    @classmethod
    def from_config(cls, cfg, fitted: bool = False) -> CommLinks:
        """From a ``SpLayoutConfig`` (GB/s): the deployment's links, or with ``fitted`` those
        its latency profile was fitted on."""
        intra, inter = ((cfg.fit_intra_node_gbps, cfg.fit_inter_node_gbps) if fitted
                        else (cfg.intra_node_gbps, cfg.inter_node_gbps))
        return cls(intra * 1e9, inter * 1e9, cfg.message_latency_s, cfg.bytes_per_element)


def layout_volume(layout: str, g: ModelGeometry, sp: int, history: int, tokens: int) -> float:
    """Elements moved per layer, summed over the group (module docstring; Appendix A)."""
    n, h, l, dh = sp, history, tokens, g.head_dim
    if layout == "ring":
        return (n - 1) * (h + l) * 2 * g.num_kv_heads * dh
    if layout == "a2a":   # KV heads replicated past N > Hkv: R = max(Hkv, N) heads travel
        return (n - 1) / n * (2 * l * g.num_heads * dh + 2 * (h + l) * max(g.num_kv_heads, n) * dh)
    if layout == "allgather":
        return 2 * l * g.hidden * (n - 1)
    if layout == "sptp":
        return 2 * l * g.model_hidden * (n - 1) + (n - 1) / n * h * 2 * max(g.num_kv_heads, n) * dh
    if layout == "ntp_weights":   # SP-NTP's parameter all-gather on a TP deployment
        return 4 * g.hidden ** 2 * (n - 1)
    raise ValueError(f"unknown SP layout {layout!r}")


def _spread(counts: Sequence[int], pair_bytes: float, links: CommLinks) -> float:
    """One all-to-all-like exchange: every member sends ``pair_bytes`` to each other member;
    intra- and inter-node sends run at once, the slowest member's longer kind decides."""
    n = sum(counts)
    worst = 0.0
    for c in counts:
        t = max((c - 1) * pair_bytes / links.intra_node, (n - c) * pair_bytes / links.inter_node)
        worst = max(worst, t)
    return worst + links.message_latency_s


def _hierarchical(counts: Sequence[int], rows: float, links: CommLinks) -> float:
    """One hierarchical all-gather (or reduce-scatter) of ``rows`` bytes per member
    (actors/prefill/sptp_hier.py). Nodes of equal size ``G`` use rails: each member sends its
    rows to its counterpart on each of the other ``k−1`` nodes, then ``k`` row sets to each of
    its ``G−1`` node peers (two steps). Otherwise one leader per node: inside each node, each
    leader sends its node's rows once to every other leader, leaders forward the remote rows
    (three steps, the slowest node each)."""
    n, k = sum(counts), len(counts)
    if len(set(counts)) == 1:
        g = counts[0]
        return ((k - 1) * rows / links.inter_node + (g - 1) * k * rows / links.intra_node
                + 2 * links.message_latency_s)
    inside = max((c - 1) * rows for c in counts) / links.intra_node
    across = max(c * rows * (k - 1) for c in counts) / links.inter_node
    forward = max((c - 1) * (n - c) * rows for c in counts) / links.intra_node
    return inside + across + forward + 3 * links.message_latency_s


def _ring_step(g: ModelGeometry, links: CommLinks, node_counts: Sequence[int], history: int,
               tokens: int) -> float:
    """One ring step's transfer: a member's KV block over the group's slowest hop."""
    n = sum(node_counts)
    hop = links.inter_node if len(node_counts) > 1 else links.intra_node
    block = (history + tokens) / n * 2 * g.num_kv_heads * g.head_dim * links.bytes_per_element
    return block / hop + links.message_latency_s


def _a2a_phases(g: ModelGeometry, links: CommLinks, node_counts: Sequence[int], history: int,
                tokens: int) -> tuple[float, float]:
    """One layer's A2A #1 (queries, and KV of chunk and history) and A2A #2 (outputs)."""
    n, h, l, dh, b = sum(node_counts), history, tokens, g.head_dim, links.bytes_per_element
    qkv = (l / n * g.num_heads + (h + l) / n * 2 * max(g.num_kv_heads, n)) / n * dh * b
    out = l / n * g.num_heads / n * dh * b
    return _spread(node_counts, qkv, links), _spread(node_counts, out, links)


def layout_time(layout: str, g: ModelGeometry, links: CommLinks, node_counts: Sequence[int],
                history: int, tokens: int, attention_s: float = 0.0) -> float:
    """Exposed seconds of communication for the whole chunk (all layers) on a group whose
    members sit ``node_counts[k]`` to a node; ``attention_s`` hides ring transfers."""
    n = sum(node_counts)
    if n <= 1:
        return 0.0
    h, l, dh, b = history, tokens, g.head_dim, links.bytes_per_element
    if layout == "ring":
        hidden = attention_s / (g.num_layers * n)
        per_layer = (n - 1) * max(0.0, _ring_step(g, links, node_counts, h, l) - hidden)
    elif layout == "a2a":
        send, ret = _a2a_phases(g, links, node_counts, h, l)
        per_layer = send + ret
    elif layout == "allgather":
        rows = l / n * g.hidden * b   # each member's share of E, then of O_L
        per_layer = 2 * _spread(node_counts, rows, links)
    elif layout == "sptp":
        rows = l / n * g.model_hidden * b   # whole rows on every head slice (TP > 1)
        hist = h / n * 2 * max(g.num_kv_heads, n) / n * dh * b   # history KV per peer
        if len(node_counts) > 1:   # hierarchical collectives (actors/prefill/sptp_hier.py)
            per_layer = (_spread(node_counts, hist, links)
                         + 2 * _hierarchical(node_counts, rows, links))
        else:
            per_layer = (_spread(node_counts, rows + hist, links)
                         + _spread(node_counts, rows, links))
    elif layout == "ntp_weights":
        per_layer = _spread(node_counts, 4 * g.hidden ** 2 / n * b, links)
    else:
        raise ValueError(f"unknown SP layout {layout!r}")
    return g.num_layers * per_layer


def pipelined_time(layout: str, g: ModelGeometry, links: CommLinks, node_counts: Sequence[int],
                   history: int, tokens: int, attention_s: float, micro: int,
                   piece_overhead_s: float) -> float:
    """Exposed seconds of ``layout``/``micro`` (``"ring"`` or ``"a2a"``) for the whole chunk:
    sp_pipeline.py's overlap of ``micro`` pieces with the chunk's ``attention_s``."""
    n = sum(node_counts)
    if n <= 1:
        return 0.0
    per_member = attention_s / g.num_layers   # Eq. 1's attention of one layer on one member
    if layout == "ring":
        per_layer = exposed_ring_s(n - 1, _ring_step(g, links, node_counts, history, tokens),
                                   per_member / n, micro, piece_overhead_s)
    elif layout == "a2a":
        send, ret = _a2a_phases(g, links, node_counts, history, tokens)
        per_layer = exposed_a2a_s(send, per_member, ret, micro, piece_overhead_s)
    else:
        raise ValueError(f"SP layout {layout!r} has no pipelined executor")
    return g.num_layers * per_layer


class LayoutChoice(NamedTuple):
    layout: str
    reason: str
    delta_s: float              # T_layout − T_ring(fit), added to Eq. 1's prediction
    times: dict                 # layout (or "layout/M") -> communication seconds, as considered
    micro_partitions: int = 1   # pieces the chosen layout is pipelined over (sp_pipeline.py)
    comm_s: float = 0.0         # T_layout: the chosen layout's exposed seconds, deployment links
    ring_fit_s: float = 0.0     # T_ring(fit): the ring's exposed seconds inside Eq. 1


class LayoutChooser:
    """Picks each chunk's cheapest executable layout among ``layouts`` (ring on ties)."""

    def __init__(self, layouts: Sequence[str], geometry: ModelGeometry, links: CommLinks,
                 ring_overlap: bool = True, ntp_gathers_weights: bool = False,
                 micro_partitions: Sequence[int] = (1,), piece_overhead_s: float | None = None,
                 fit_links: CommLinks | None = None):
        self.layouts = tuple(layouts)
        self.geometry = geometry
        self.links = links
        # the links Eq. 1 was fitted on; None: the deployment's (no correction of the ring)
        self.fit_links = links if fit_links is None else fit_links
        self.ring_overlap = ring_overlap   # False: attention hides no ring transfer
        # True: members hold 1/N of the attention weights (a TP deployment, Appendix A), so
        # SP-NTP all-gathers them every layer; our TP-1 members hold them whole
        self.ntp_gathers_weights = ntp_gathers_weights
        # M the chooser may pipeline "ring" and "a2a" over (sp_pipeline.py); (1,): never
        self.micro_partitions = tuple(sorted(set(micro_partitions) | {1}))
        # one more piece's fixed cost in one exchange; the deployment's message latency
        self.piece_overhead_s = (links.message_latency_s if piece_overhead_s is None
                                 else piece_overhead_s)

    @classmethod
    def from_config(cls, cfg, geometry: ModelGeometry) -> LayoutChooser:
        """From a ``SpLayoutConfig``."""
        return cls(cfg.layouts, geometry, CommLinks.from_config(cfg), cfg.ring_overlap,
                   micro_partitions=cfg.micro_partitions,
                   fit_links=CommLinks.from_config(cfg, fitted=True))

    @property
    def ring_only(self) -> bool:
        """Every chunk is Eq. 1's own ring: nothing to choose, no link to correct for."""
        return (self.layouts == ("ring",) and self.micro_partitions == (1,)
                and self.fit_links == self.links)

    def ring_fit(self, counts: Sequence[int], history: int, tokens: int,
                 attention_s: float) -> float:
        """The ring's exposed seconds on the links Eq. 1 was fitted on, hidden behind
        attention as the deployment's ring is (``ring_overlap``)."""
        hiding = attention_s if self.ring_overlap else 0.0
        return layout_time("ring", self.geometry, self.fit_links, counts, history, tokens, hiding)

    def feasible(self, layout: str, sp: int) -> str:
        """Why ``layout`` cannot run on ``sp`` instances ("" when it can)."""
        g = self.geometry
        # head shards (actors/prefill/head_shards.py): KV heads replicated when sp > Hkv
        if layout in ("a2a", "sptp") and (
                g.num_heads % sp or (g.num_kv_heads % sp and sp % g.num_kv_heads)):
            return f"a group of {sp} cannot split {g.num_heads} heads over {g.num_kv_heads} KV heads"
        return ""

    def choose(self, members: Sequence[int], node_of: Sequence[int], history: int,
               tokens: int, attention_s: float = 0.0) -> LayoutChoice:
        counts = node_counts(members, node_of)
        hiding = attention_s if self.ring_overlap else 0.0
        times = {x: layout_time(x, self.geometry, self.links, counts, history, tokens,
                                hiding) for x in self.layouts}
        if self.ntp_gathers_weights and "a2a" in times:
            times["a2a"] += layout_time("ntp_weights", self.geometry, self.links, counts, 0, 0)
        best, notes = "ring", []
        for x in self.layouts:
            why = self.feasible(x, len(members))
            if why:
                notes.append(f"{x} out: {why}")
            elif times[x] < times[best]:
                best = x
        ranked = ", ".join(f"{x} {times[x] * 1e3:.3f} ms" for x in self.layouts)
        reason = f"comm {ranked}" + (f"; {'; '.join(notes)}" if notes else "")
        fit = self.ring_fit(counts, history, tokens, attention_s)
        if self.micro_partitions == (1,):
            return LayoutChoice(best, reason, times[best] - fit, times, 1, times[best], fit)
        return self._pieces(LayoutChoice(best, reason, 0.0, times, 1, times[best], fit), counts,
                            len(members), history, tokens, attention_s)

    def _pieces(self, whole: LayoutChoice, counts: list[int], sp: int, history: int,
                tokens: int, attention_s: float) -> LayoutChoice:
        """``whole`` (the choice over unpipelined layouts) against every pipelined ``x/M``
        (sp_pipeline.py): the cheapest wins, whole layouts and fewer pieces on ties. The ring's
        pieces hide only behind attention it may overlap (``ring_overlap``); the all-to-all's
        three phases always overlap the chunk's attention."""
        times = dict(whole.times)
        best, best_m = whole.layout, 1
        for x in ("ring", "a2a"):
            if x not in self.layouts or self.feasible(x, sp):
                continue
            att = attention_s if x == "a2a" or self.ring_overlap else 0.0
            for m in self.micro_partitions[1:]:
                key = f"{x}/{m}"
                times[key] = pipelined_time(x, self.geometry, self.links, counts, history,
                                            tokens, att, m, self.piece_overhead_s)
                if x == "a2a" and self.ntp_gathers_weights:   # gathered once, not per piece
                    times[key] += times["a2a"] - layout_time(
                        "a2a", self.geometry, self.links, counts, history, tokens)
                if times[key] < times[best if best_m == 1 else f"{best}/{best_m}"]:
                    best, best_m = x, m
        pieces = ", ".join(f"{k} {t * 1e3:.3f} ms" for k, t in times.items() if "/" in k)
        chosen = best if best_m == 1 else f"{best}/{best_m}"
        reason = (f"{whole.reason}; pieces {pieces or 'none'}; "
                  f"{chosen} cheapest (piece overhead {self.piece_overhead_s * 1e6:.1f} us)")
        return LayoutChoice(best, reason, times[chosen] - whole.ring_fit_s, times, best_m,
                            times[chosen], whole.ring_fit_s)


def node_counts(members: Sequence[int], node_of: Sequence[int]) -> list[int]:
    """Members per node, nodes in first-seen order."""
    counts: dict[int, int] = {}
    for i in members:
        counts[node_of[i]] = counts.get(node_of[i], 0) + 1
    return list(counts.values())
