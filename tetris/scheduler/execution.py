"""What the hardware takes to run a chunk, as distinct from what the scheduler believes.

Shared by the simulator (``tetris.sim``) and the emulated prefill workers
(``actors/prefill/worker.py``), so neither imports the other; no torch, no Ray.

The scheduler plans with its fitted latency model (Eq. 1, ``PrefillLatencyModel``); a real
cluster then runs each chunk in whatever time the GPUs take. The simulator can execute either:

- ``"profile"``: the fit itself. Execution equals the plan (``max_plan_deviation_s`` is 0), the
  model every unit test and earlier result used.
- ``"measured"``: the profile's measurements where it has them. At ``h = 0`` a chunk of a
  measured length takes exactly the measured time; between measured lengths the fit is
  scaled by the measured/fit ratio, interpolated linearly in ``log(tokens)``; below the
  shortest and above the longest measured length the ratio of the nearest end is held. A
  chunk with history ``h`` is the fit's ``T_s(h, l)`` scaled by the ratio at ``h + l`` (the
  context it ends at): the measurements have no history, so the fit's shape carries it.

With ``"measured"``, CDSP's chunks, cut to fill gaps the fit predicts, overrun or underrun
them as they would on the hardware, and every policy's GPU time is the measured one. On the
8B profile the fit is within 0.5% of Table 1 at SP 1 but up to 5.9% off at SP 8/16 (its
SP-8 times are ~3.5% fast over Long's lengths; docs/simulation.md, "Execution on the
measurements").
"""

from __future__ import annotations

import bisect
import math
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable

from tetris.scheduler.latency import (LatencySample, PrefillLatencyModel, ProfileError,
                                      read_table_csv)

__all__ = ["EXECUTION_MODELS", "MeasuredLatency", "execution_latency", "measurements_path",
           "write_scaled_table"]

EXECUTION_MODELS = ("profile", "measured")

LatencyFn = Callable[[int, int, int], float]


class MeasuredLatency:
    """The fit corrected to its measurements (module docstring); call as ``(sp, h, l) -> s``.

    Only ``h = 0`` samples are used; every SP size of ``model`` needs at least one.
    """

    def __init__(self, model: PrefillLatencyModel, samples: Iterable[LatencySample]):
        points: dict[int, dict[int, float]] = {}
        for s in samples:
            if s.history_tokens == 0:
                points.setdefault(s.sp_size, {})[s.chunk_tokens] = s.seconds
        missing = [sp for sp in model.sp_sizes if sp not in points]
        if missing:
            raise ProfileError(f"profile {model.name!r}: no measurement with h = 0 for SP sizes "
                               f"{missing}; measured execution needs one per SP size")
        self.model = model
        # sp -> (log tokens ascending, measured / fit at each)
        self._curve: dict[int, tuple[list[float], list[float]]] = {}
        for sp in model.sp_sizes:
            rows = sorted(points[sp].items())
            self._curve[sp] = ([math.log(n) for n, _ in rows],
                               [t / model.predict(sp, 0, n) for n, t in rows])

    def ratio(self, sp: int, context_tokens: float) -> float:
        """Measured / fit at ``context_tokens`` (log-linear between measured lengths)."""
        xs, ys = self._curve[sp]
        x = math.log(max(context_tokens, 1.0))
        k = bisect.bisect_right(xs, x)
        if k == 0:
            return ys[0]
        if k == len(xs):
            return ys[-1]
        w = (x - xs[k - 1]) / (xs[k] - xs[k - 1])
        return ys[k - 1] + w * (ys[k] - ys[k - 1])

    def __call__(self, sp: int, history_tokens: int, chunk_tokens: int) -> float:
        # predict first: it names an SP size the profile lacks (ProfileError), and every size
        # the profile has has a curve (checked in __init__), so no check on this hot path.
        fit = self.model.predict(sp, history_tokens, chunk_tokens)
        return fit * self.ratio(sp, history_tokens + chunk_tokens)

    # The emulated prefill executor (actors/prefill/executor.py) asks a profile for ``predict``.
    predict = __call__


def measurements_path(name: str) -> Path:
    """A measurement table shipped in ``configs/profiles/`` (or a path as given)."""
    p = Path(name)
    if p.is_file():
        return p
    res = resources.files("tetris.configs").joinpath("profiles", name)
    if not res.is_file():
        raise ProfileError(f"{name}: no such measurement table")
    return Path(str(res))


def write_scaled_table(name: str, factor: float, path: str | Path) -> Path:
    """The measurement table ``name`` with every time × ``factor``, written to ``path`` (CSV).

    A time-scaled emulation scales its profile and its measurements alike: the measured/fit
    ratio is then unchanged and the waits scale by ``factor``.
    """
    samples = read_table_csv(measurements_path(name))
    sizes = sorted({s.sp_size for s in samples})
    rows: dict[tuple[int, int], dict[int, float]] = {}
    for s in samples:
        rows.setdefault((s.history_tokens, s.chunk_tokens), {})[s.sp_size] = s.seconds * factor
    out = Path(path)
    lines = [f"# {name} with every time x {factor:g} (a time-scaled emulation)",
             "history_tokens,prompt_tokens," + ",".join(f"sp{sp}" for sp in sizes)]
    for (h, n), cells in sorted(rows.items()):
        lines.append(f"{h},{n}," + ",".join(repr(cells[sp]) if sp in cells else ""
                                             for sp in sizes))
    out.write_text("\n".join(lines) + "\n")
    return out


def execution_latency(kind: str, model: PrefillLatencyModel,
                      measurements: str | None) -> LatencyFn:
    """The chunk-time function a simulated pool executes with (module docstring)."""
    if kind == "profile":
        return model.predict
    if kind == "measured":
        if measurements is None:
            raise ProfileError(f"profile {model.name!r} has no measurements (it is derived, not "
                               "profiled); use execution 'profile'")
        return MeasuredLatency(model, read_table_csv(measurements_path(measurements)))
    raise ValueError(f"execution is one of {', '.join(EXECUTION_MODELS)}, got {kind!r}")
