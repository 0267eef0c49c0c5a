"""The Ray Serve application: ``build_app(config)``.

Deployment graph (one replica each; the pools are stateful)::

    HTTP /v1/... ──► Ingress (FastAPI: OpenAI API, /metrics, /admin/...)
    handle.generate / generate_stream ──┘   │ tokenizes, validates, streams
                                            ▼
                                   Dispatcher (asyncio on uvloop) + supervisor
                                   ControlPlane: policy, queue, decode router, θ
                        commit/run plan │                    │ reserve/commit/stream
                                        ▼                    ▼
                         PrefillPoolServer            DecodePoolServer
                         N PrefillWorker actors       M DecodeInstances, each a TP group
                         (one gloo world)             of DecodeRank actors
                                        └── KV, layer by layer ──┘
                             (NIXL writes; control messages actor to actor)

The pools own the actors (``pools``); the dispatcher owns the control state
(``dispatcher_server``, its ``supervisor`` heals the pools); the ingress owns nothing but the
HTTP (and handle) surface (``ingress``). This module only builds the graph.
"""

from __future__ import annotations

from pathlib import Path

from tetris.config import DeploymentConfig, load_deployment
from tetris.serve.dispatcher_server import PREFILL_CHECK_S, DispatcherServer
from tetris.serve.ingress import Ingress
from tetris.serve.pools import DecodePoolServer, PrefillPoolServer
from tetris.serve.supervisor import check_period

__all__ = ["build_app", "app_builder", "APP_NAME", "Ingress", "DispatcherServer",
           "PrefillPoolServer", "DecodePoolServer"]

APP_NAME = "tetris"


def build_app(config: DeploymentConfig | str | Path | None = None, *, max_pending: int = 256,
              prefill_check_s: float = PREFILL_CHECK_S):
    """The Serve application for a deployment (a TOML path, a loaded config, or the default).
    ``max_pending``: requests queued before 429s; ``prefill_check_s``: how often prefill
    workers are probed for ones that died idle (0: never)."""
    deployment = config if isinstance(config, DeploymentConfig) else load_deployment(config)
    prefill = PrefillPoolServer.bind(deployment)
    decode = DecodePoolServer.bind(deployment)
    dispatcher = DispatcherServer.bind(deployment, prefill, decode, max_pending,
                                       check_period(prefill_check_s))
    return Ingress.bind(deployment, dispatcher, decode)


def app_builder(args: dict):
    """Entry point for ``serve run`` config files: ``args: {config: PATH, max_pending: N,
    prefill_check_s: S}``."""
    return build_app(args.get("config"), max_pending=int(args.get("max_pending", 256)),
                     prefill_check_s=float(args.get("prefill_check_s", PREFILL_CHECK_S)))
