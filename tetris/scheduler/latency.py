"""Prefill latency model (SPEC §2, paper Eq. 1), its least-squares fit, and profile files.

    T_s(h, l) = α_s + β_s·l + γ_s·h·l + δ_s·l²

``h`` is the chunk's history (tokens of earlier chunks of the same request), ``l`` the chunk's
own tokens, ``s`` the SP size. One coefficient set per SP size; a *profile* is the set for one
(model, hardware, TP size), stored as JSON under ``configs/profiles/``.

The CDSP search calls ``predict`` and ``solve_chunk_tokens`` hundreds of times per decision,
so both read plain floats from a dict keyed by SP size; no numpy on that path.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import Iterable

import msgspec
import numpy as np

__all__ = [
    "ProfileError",
    "LatencySample",
    "SpCoefficients",
    "PrefillProfile",
    "PrefillLatencyModel",
    "load_profile",
    "embedded_profiles",
    "read_table_csv",
    "derive_llama3_70b_tp4",
]

# γ cannot be identified from h = 0 samples. A history pair costs what a causal pair costs,
# and a chunk of l tokens has l²/2 causal pairs but h·l history pairs, hence γ = 2·δ (SPEC §2).
DEFAULT_GAMMA_OVER_DELTA = 2.0


class ProfileError(ValueError):
    """A latency profile or sample set is invalid or cannot be found."""


class LatencySample(msgspec.Struct, frozen=True):
    """One profiled prefill: ``seconds`` for ``chunk_tokens`` after ``history_tokens`` at ``sp_size``."""

    sp_size: int
    history_tokens: int
    chunk_tokens: int
    seconds: float


class SpCoefficients(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    sp_size: int
    alpha: float
    beta: float
    gamma: float
    delta: float


class PrefillProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The file format of a profile (JSON)."""

    name: str
    coefficients: list[SpCoefficients]
    model: str = ""
    hardware: str = ""
    tp_size: int = 1
    source: str = ""
    notes: list[str] = []
    max_relative_error: float | None = None


class PrefillLatencyModel:
    """Eq. 1 with one coefficient set per SP size."""

    def __init__(self, coefficients: Iterable[SpCoefficients], *, name: str = "",
                 model: str = "", hardware: str = "", tp_size: int = 1, source: str = "",
                 notes: Iterable[str] = (), max_relative_error: float | None = None):
        coeffs = sorted(coefficients, key=lambda c: c.sp_size)
        if not coeffs:
            raise ProfileError(f"profile {name!r}: no coefficients")
        seen: set[int] = set()
        for c in coeffs:
            if c.sp_size <= 0 or c.sp_size in seen:
                raise ProfileError(f"profile {name!r}: SP sizes must be positive and distinct")
            seen.add(c.sp_size)
            if min(c.beta, c.gamma, c.delta) < 0:
                raise ProfileError(
                    f"profile {name!r}: SP {c.sp_size} has a negative β, γ or δ; latency would "
                    "fall as tokens grow"
                )
        self.coefficients = tuple(coeffs)
        self.name = name
        self.model = model
        self.hardware = hardware
        self.tp_size = tp_size
        self.source = source
        self.notes = tuple(notes)
        self.max_relative_error = max_relative_error
        # sp -> (α, β, γ, δ): the hot path of the scheduler reads these directly.
        self.table: dict[int, tuple[float, float, float, float]] = {
            c.sp_size: (c.alpha, c.beta, c.gamma, c.delta) for c in coeffs
        }

    @property
    def sp_sizes(self) -> tuple[int, ...]:
        return tuple(c.sp_size for c in self.coefficients)

    def _coeffs(self, sp: int) -> tuple[float, float, float, float]:
        try:
            return self.table[sp]
        except KeyError:
            raise ProfileError(
                f"profile {self.name!r} has no coefficients for SP size {sp}; "
                f"it has {list(self.sp_sizes)}"
            ) from None

    def predict(self, sp: int, history_tokens: float, chunk_tokens: float) -> float:
        """Seconds to prefill ``chunk_tokens`` after ``history_tokens`` on ``sp`` instances (Eq. 1)."""
        a, b, g, d = self._coeffs(sp)
        h, l = history_tokens, chunk_tokens
        return a + l * (b + g * h + d * l)

    def solve_chunk_tokens(self, sp: int, history_tokens: float, budget_s: float) -> float:
        """The chunk length ``l`` with ``T_sp(h, l) = budget_s`` (Algorithm 3); 0 if none fits.

        Eq. 1 is quadratic in ``l``: δ·l² + (β + γ·h)·l − (budget − α) = 0. The positive root is
        taken in the cancellation-free form 2c / (B + sqrt(B² + 4δc)), c = budget − α, which
        also covers δ = 0; no Newton iterations are needed.
        """
        a, b, g, d = self._coeffs(sp)
        return _root(a, b + g * history_tokens, d, budget_s)

    # ---- fitting --------------------------------------------------------------------------

    @classmethod
    def fit(cls, samples: Iterable[LatencySample], *, name: str = "fitted",
            gamma_over_delta: float = DEFAULT_GAMMA_OVER_DELTA, **meta) -> "PrefillLatencyModel":
        """Least squares per SP size with residuals relative to the measured time (SPEC §2).

        Minimises Σ ((T̂ − T)/T)², i.e. rows scaled by 1/T, so 4k and 256k prompts count alike.
        γ is fitted only when some sample of that SP size has history; otherwise γ = ratio·δ.
        A coefficient that comes out negative is pinned to zero and the rest refitted.
        """
        by_sp: dict[int, list[LatencySample]] = {}
        for s in samples:
            if s.seconds <= 0 or s.chunk_tokens <= 0 or s.history_tokens < 0:
                raise ProfileError(f"invalid latency sample {s}")
            by_sp.setdefault(s.sp_size, []).append(s)
        if not by_sp:
            raise ProfileError("no latency samples to fit")
        coeffs = [_fit_one(sp, by_sp[sp], gamma_over_delta) for sp in sorted(by_sp)]
        model = cls(coeffs, name=name, **meta)
        errs = model.relative_errors(s for ss in by_sp.values() for s in ss)
        model.max_relative_error = max(abs(e) for _, e in errs)
        return model

    def relative_errors(self, samples: Iterable[LatencySample]) -> list[tuple[LatencySample, float]]:
        """(sample, predicted/measured − 1) for each sample."""
        return [
            (s, self.predict(s.sp_size, s.history_tokens, s.chunk_tokens) / s.seconds - 1.0)
            for s in samples
        ]

    # ---- files ----------------------------------------------------------------------------

    def to_profile(self) -> PrefillProfile:
        return PrefillProfile(
            name=self.name, coefficients=list(self.coefficients), model=self.model,
            hardware=self.hardware, tp_size=self.tp_size, source=self.source,
            notes=list(self.notes), max_relative_error=self.max_relative_error,
        )

    @classmethod
    def from_profile(cls, p: PrefillProfile) -> "PrefillLatencyModel":
        return cls(p.coefficients, name=p.name, model=p.model, hardware=p.hardware,
                   tp_size=p.tp_size, source=p.source, notes=p.notes,
                   max_relative_error=p.max_relative_error)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(msgspec.json.format(msgspec.json.encode(self.to_profile()), indent=2) + b"\n")
        return p

    @classmethod
    def load(cls, name_or_path: str | Path) -> "PrefillLatencyModel":
        return load_profile(name_or_path)

    def scaled(self, *, name: str, linear: float, attention: float, overhead: float,
               **meta) -> "PrefillLatencyModel":
        """A derived profile: β × linear, γ and δ × attention, α × overhead (see docs/scheduler.md)."""
        coeffs = [
            SpCoefficients(c.sp_size, c.alpha * overhead, c.beta * linear,
                           c.gamma * attention, c.delta * attention)
            for c in self.coefficients
        ]
        return PrefillLatencyModel(coeffs, name=name, **meta)

    def __repr__(self) -> str:
        return f"PrefillLatencyModel({self.name!r}, sp_sizes={list(self.sp_sizes)})"


def _root(a: float, lin: float, d: float, budget: float) -> float:
    c = budget - a
    if c <= 0.0:
        return 0.0
    return 2.0 * c / (lin + math.sqrt(lin * lin + 4.0 * d * c))


def _fit_one(sp: int, rows: list[LatencySample], gamma_over_delta: float) -> SpCoefficients:
    h = np.array([r.history_tokens for r in rows], dtype=float)
    l = np.array([r.chunk_tokens for r in rows], dtype=float)
    t = np.array([r.seconds for r in rows], dtype=float)
    free_gamma = bool((h > 0).any())
    # Columns α, β, γ, δ; without history γ rides on δ's column with its fixed ratio.
    cols = [np.ones_like(l), l, h * l, l * l] if free_gamma else \
        [np.ones_like(l), l, gamma_over_delta * h * l + l * l]
    active = list(range(len(cols)))
    if len(rows) < len(cols):
        raise ProfileError(f"SP {sp}: {len(rows)} samples cannot fit {len(cols)} coefficients")
    while True:
        a = np.stack([cols[i] for i in active], axis=1) / t[:, None]
        x, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
        neg = [active[k] for k in range(len(active)) if x[k] < 0 and active[k] != 0]
        if not neg:
            break
        active.remove(neg[0])
    full = [0.0] * len(cols)
    for k, i in enumerate(active):
        full[i] = float(x[k])
    if free_gamma:
        alpha, beta, gamma, delta = full
    else:
        alpha, beta, delta = full
        gamma = gamma_over_delta * delta
    return SpCoefficients(sp_size=sp, alpha=alpha, beta=beta, gamma=gamma, delta=delta)


def read_table_csv(path: str | Path) -> list[LatencySample]:
    """Samples from a CSV with ``prompt_tokens`` (and optional ``history_tokens``) and ``spK`` columns.

    Lines starting with ``#`` are comments; an empty cell is a missing measurement (e.g. OOM).
    """
    import csv

    p = Path(path)
    try:
        lines = [ln for ln in p.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    except OSError as e:
        raise ProfileError(f"{p}: {e.strerror}") from None
    reader = csv.DictReader(lines)
    fields = reader.fieldnames or []
    sp_cols = [(int(f[2:]), f) for f in fields if f.startswith("sp") and f[2:].isdigit()]
    if "prompt_tokens" not in fields or not sp_cols:
        raise ProfileError(f"{p}: needs a prompt_tokens column and spK columns, has {fields}")
    out: list[LatencySample] = []
    for n, row in enumerate(reader, start=2):
        try:
            l_tok = int(row["prompt_tokens"])
            h_tok = int(row.get("history_tokens") or 0)
            for sp, col in sorted(sp_cols):
                cell = (row.get(col) or "").strip()
                if cell:
                    out.append(LatencySample(sp, h_tok, l_tok, float(cell)))
        except ValueError as e:
            raise ProfileError(f"{p}: row {n}: {e}") from None
    return out


def _profiles_dir():
    return resources.files("tetris.configs").joinpath("profiles")


def embedded_profiles() -> list[str]:
    """Names of the profiles shipped in ``configs/profiles/``."""
    return sorted(
        f.name.removesuffix(".json") for f in _profiles_dir().iterdir() if f.name.endswith(".json")
    )


_CACHE: dict[str, PrefillLatencyModel] = {}


def load_profile(name_or_path: str | Path) -> PrefillLatencyModel:
    """A profile from a JSON file path or an embedded name such as ``a100-llama3-8b-tp1``."""
    key = str(name_or_path)
    p = Path(key)
    if p.is_file():
        data = p.read_bytes()
    elif key in _CACHE:
        return _CACHE[key]
    else:
        res = _profiles_dir().joinpath(key if key.endswith(".json") else key + ".json")
        if not res.is_file():
            raise ProfileError(
                f"{key}: no such profile file, nor an embedded profile "
                f"(embedded: {', '.join(embedded_profiles())})"
            )
        data = res.read_bytes()
    try:
        prof = msgspec.json.decode(data, type=PrefillProfile)
    except msgspec.ValidationError as e:
        raise ProfileError(f"{key}: {e}") from None
    model = PrefillLatencyModel.from_profile(prof)
    if not p.is_file():  # embedded files never change while running; user files may
        _CACHE[key] = model
    return model


def derive_llama3_70b_tp4(base: PrefillLatencyModel) -> PrefillLatencyModel:
    """LLaMA3-70B on TP=4 A100 instances, scaled from the LLaMA3-8B TP=1 fit (no measurements).

    Assumptions (docs/scheduler.md):
    - linear-layer FLOPs per token scale with non-embedding parameters:
      70B 80·(2·8192² + 2·8192·1024 + 3·8192·28672) = 68.45e9, 8B 32·(2·4096² + 2·4096·1024
      + 3·4096·14336) = 6.98e9, ratio 9.80;
    - attention FLOPs per token pair scale with layers × hidden size: 80·8192 / (32·4096) = 5.0;
    - TP=4 divides an instance's work by 4 at 85% efficiency (exposed all-reduces): × 1/3.4;
    - constant overheads (launches, ring set-up per layer) scale with layers: × 2.5.
    """
    tp_speedup = 4 * 0.85
    return base.scaled(
        name="a100-llama3-70b-tp4", linear=9.80 / tp_speedup, attention=5.0 / tp_speedup,
        overhead=2.5, model="LLaMA3-70B", hardware="A100-SXM4-80GB", tp_size=4,
        source=f"derived from {base.name} by FLOP scaling (not measured)",
        notes=[
            "beta x 9.80/3.4: linear FLOPs 68.45e9 vs 6.98e9 non-embedding params, TP4 at 85%",
            "gamma, delta x 5.0/3.4: attention FLOPs per token pair, layers*hidden 80*8192 vs 32*4096",
            "alpha x 2.5: per-layer constant overheads, 80 vs 32 layers",
        ],
    )
