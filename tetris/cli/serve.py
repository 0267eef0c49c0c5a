"""``tetris serve``: start Ray, deploy the Tetris Serve app and print its URL.

    tetris serve                                  # the embedded tiny CPU deployment
    tetris serve --config configs/paper.toml --port 8000
    tetris serve --address auto                   # join a running Ray cluster

It blocks until Ctrl-C (or SIGTERM), then shuts Serve down. ``--ready-file`` writes the URL to
a file once the app answers, for scripts that start the server in the background. Users of
``serve run`` get the same app from ``configs/serve-tiny-cpu.yaml``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

__all__ = ["register", "run"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="start Ray and serve the OpenAI-compatible API",
        description="Start Ray (or join a cluster), deploy the Tetris app and serve HTTP.")
    p.add_argument("--config", metavar="DEPLOYMENT_TOML",
                   help="deployment file (default: the embedded tiny-cpu.toml)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None,
                   help="Ray cluster address ('auto' joins a running cluster; default: start "
                        "a local one)")
    p.add_argument("--max-pending", type=int, default=256,
                   help="requests in flight before new ones get 429 (default 256)")
    p.add_argument("--prefill-check-s", type=float, default=2.0, metavar="S",
                   help="probe the prefill workers every S seconds and replace ones that died "
                        "idle (0: only when a chunk finds one; default 2)")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="write the URL here once the app is ready")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    from tetris.actors.process_env import SERVE_ENV_VARS

    # Before Ray starts: Serve reads it at import, and the Ray it starts passes it to every
    # worker (Serve's controller and proxy included): a metrics flush every 1 s, not 100 ms.
    for key, value in SERVE_ENV_VARS.items():
        os.environ.setdefault(key, value)
    from tetris.serve import ray_idle

    ray_idle.apply(os.environ)   # longer idle timers in the Ray it starts (the module says which)
    import ray
    from ray import serve

    from tetris.config import ConfigError, load_deployment
    from tetris.serve.app import APP_NAME, build_app

    try:
        deployment = load_deployment(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.max_pending <= 0:
        print("error: --max-pending must be positive", file=sys.stderr)
        return 2
    if not args.prefill_check_s >= 0:
        print("error: --prefill-check-s must be >= 0", file=sys.stderr)
        return 2
    ray.init(address=args.address, include_dashboard=False, configure_logging=False)
    from tetris.device import check_cluster_gpus

    try:   # GPUs no node has would leave actors waiting forever: fail now, naming CUDA
        check_cluster_gpus(deployment, ray.cluster_resources().get("GPU", 0.0))
    except ConfigError as e:
        ray.shutdown()
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        print(f"deploying {deployment.model.name} ({deployment.prefill.num_instances} prefill "
              f"instances, {deployment.decode.num_instances} decode x TP "
              f"{deployment.decode.tp_size}) ...", file=sys.stderr)
        serve.run(build_app(deployment, max_pending=args.max_pending,
                            prefill_check_s=args.prefill_check_s), name=APP_NAME,
                  route_prefix="/")
        serve.get_deployment_handle("DispatcherServer", APP_NAME).warmup.remote().result()
        url = f"http://{args.host}:{args.port}"
        print(f"Tetris is serving {deployment.model.name} at {url}/v1 (Ctrl-C to stop)")
        sys.stdout.flush()
        if args.ready_file is not None:
            args.ready_file.write_text(url + "\n")
        _wait_for_signal()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _wait_for_signal() -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
