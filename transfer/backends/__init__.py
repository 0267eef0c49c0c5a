"""Transfer backends, chosen by capability: NIXL over UCX by default, in-process otherwise.

``make_agent(name)`` returns a NIXL agent when ``nixl`` imports and its UCX plugin starts;
if not, it logs a WARNING that says why and returns an in-process agent, which only reaches
agents of the same process (``agent.capabilities.cross_process`` is False). Never silent. ``"emulated"`` (EMULATION) times
writes from the config's link bandwidth and moves no payload (``backends/emulated.py``).
"""

from __future__ import annotations

import logging
from typing import Literal

from tetris.config import TransferConfig
from tetris.transfer.backends.base import BackendCapabilities, TransferAgent, WriteStatus
from tetris.transfer.backends.inproc import InProcAgent

__all__ = ["make_agent", "TransferAgent", "BackendCapabilities", "WriteStatus", "InProcAgent",
           "nixl_unavailable_reason"]

log = logging.getLogger(__name__)

BackendChoice = Literal["auto", "nixl", "inproc", "emulated"]


def nixl_unavailable_reason() -> str | None:
    """None when NIXL with UCX can be used here, else why not."""
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as exc:  # ImportError, or the wheel's own CUDA detection failing
        return f"nixl cannot be imported ({type(exc).__name__}: {exc})"
    return None


def make_agent(name: str, backend: BackendChoice = "auto",
               config: TransferConfig | None = None) -> TransferAgent:
    """A transfer agent named ``name`` (unique per cluster) on the chosen backend; ``config``
    gives the emulated backend its link (defaults: ``TransferConfig()``)."""
    if backend == "emulated":
        from tetris.transfer.backends.emulated import EmulatedAgent

        cfg = config or TransferConfig()
        return EmulatedAgent(name, bandwidth=cfg.emulated_link_bandwidth,
                             bytes_per_wire_byte=cfg.emulated_bytes_per_wire_byte)
    if backend == "inproc":
        return InProcAgent(name)
    reason = nixl_unavailable_reason()
    if reason is None:
        from tetris.transfer.backends.nixl_ucx import NixlAgent

        try:
            return NixlAgent(name)
        except Exception as exc:
            reason = f"NIXL agent with UCX failed to start ({type(exc).__name__}: {exc})"
    if backend == "nixl":
        raise RuntimeError(f"transfer backend 'nixl' requested but {reason}")
    log.warning("KV transfer falls back to the in-process backend (same process only): %s", reason)
    return InProcAgent(name)
