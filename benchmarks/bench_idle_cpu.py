"""CPU an idle deployment burns: every process of a `tetris serve`, over a window with no requests.

    python benchmarks/bench_idle_cpu.py                      # configs/tiny-cpu.toml, 30 s window
    python benchmarks/bench_idle_cpu.py --json --threads 3   # machine-readable, busiest threads
    python benchmarks/bench_idle_cpu.py --pid 1234           # an already running `tetris serve`

Starts ``tetris serve`` as a subprocess (its own local Ray, a free port), waits for it to answer,
sends one completion to warm every path (prefill pool, KV transfer, decode), waits for the pool to
settle, then measures the CPU time (user + system) of every process of the server's tree over the
window with psutil: the driver, Ray's system processes (gcs_server, raylet, dashboard, log
monitor, agents) and every worker process, named by its ``ray::`` title.

Processes are classified as
  tetris   the app's Serve replicas (``ray::ServeReplica:<app>:...``), its actors (prefill workers,
           decode ranks, anything else titled ``ray::`` that Ray does not start) and the
           ``tetris serve`` driver;
  serve    Ray Serve's own actors (``ServeController``, ``ProxyActor``);
  ray      Ray's system processes (gcs_server, raylet, dashboard, agents, idle workers).
The exit status is 1 when the tetris total reaches ``--limit`` percent of one core (default 5).

``--floor`` then measures the same process graph with no Tetris code in it, in a Ray started
the same way: an ingress replica calling a dispatcher replica calling two pool replicas, which
own as many bare actors as the deployment has prefill workers and decode ranks. That is what
Ray and Serve cost idle for that many processes (every Ray worker's main thread wakes every
10 ms to check for signals, Serve's replicas and handles run their own timers); ``--limit-over-floor``
fails the run when Tetris's total exceeds the floor's by that much.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent

# ``ray::<Name>`` titles of actors that Ray (or Ray Serve) starts, not the app.
_RAY_ACTORS = {"DashboardAgent", "RuntimeEnvAgent", "IDLE", "JobSupervisor"}
_SERVE_ACTORS = {"ServeController", "ProxyActor", "HTTPProxyActor"}


def classify(title: str, *, driver: bool = False) -> tuple[str, str]:
    """(category, short name) of a process from its title (``cmdline`` joined)."""
    if driver:
        return "tetris", "driver (tetris serve)"
    if title.startswith("ray::"):
        name = title[len("ray::"):].split()[0] if title[len("ray::"):].strip() else "?"
        if name.startswith("ServeReplica:"):
            # ServeReplica:<app>:<Deployment>[.method]
            parts = name.split(":")
            dep = parts[2].split(".")[0] if len(parts) > 2 else name
            return "tetris", f"replica {dep}"
        base = name.split(".")[0]
        if base in _SERVE_ACTORS:
            return "serve", base
        if base in _RAY_ACTORS:
            return "ray", base
        return "tetris", base
    exe = os.path.basename(title.split()[0]) if title.strip() else "?"
    for key in ("gcs_server", "raylet", "dashboard.py", "log_monitor.py", "monitor.py",
                "runtime_env", "agent"):
        if key in title:
            return "ray", key.replace(".py", "")
    return "ray", exe


def _title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()).strip() or p.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "?"


def _tree(root: int) -> list[psutil.Process]:
    p = psutil.Process(root)
    return [p, *p.children(recursive=True)]


def _cpu(p: psutil.Process) -> tuple[float, float] | None:
    try:
        t = p.cpu_times()
        return t.user, t.system
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _threads(p: psutil.Process) -> dict[int, tuple[float, float]]:
    try:
        return {t.id: (t.user_time, t.system_time) for t in p.threads()}
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}


def _thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def measure(root: int, window_s: float, *, top_threads: int = 0) -> dict:
    """CPU seconds of every process under ``root`` (itself included) over ``window_s``."""
    return measure_many([root], window_s, top_threads=top_threads)[0]


def measure_many(roots: list[int], window_s: float, *, top_threads: int = 0) -> list[dict]:
    """``measure`` for several process trees over the same window (side by side)."""
    befores = [{p.pid: (p, _cpu(p), _threads(p) if top_threads else {}) for p in _tree(r)}
               for r in roots]
    t0 = time.monotonic()
    time.sleep(window_s)
    wall = time.monotonic() - t0
    return [_usage(r, b, wall, top_threads) for r, b in zip(roots, befores)]


def _usage(root: int, before: dict, wall: float, top_threads: int) -> dict:
    rows = []
    for p in _tree(root):
        after = _cpu(p)
        if after is None:
            continue
        prev = before.get(p.pid)
        start = prev[1] if prev is not None and prev[1] is not None else (0.0, 0.0)
        user, system = after[0] - start[0], after[1] - start[1]
        category, name = classify(_title(p), driver=(p.pid == root))
        row = {"pid": p.pid, "name": name, "category": category,
               "user_s": round(user, 3), "system_s": round(system, 3),
               "cpu_pct": round(100.0 * (user + system) / wall, 2),
               "new": prev is None}
        if top_threads:
            t_before = prev[2] if prev is not None else {}
            busy = []
            for tid, (u, s) in _threads(p).items():
                u0, s0 = t_before.get(tid, (0.0, 0.0))
                busy.append((u + s - u0 - s0, tid))
            busy.sort(reverse=True)
            row["threads"] = [{"tid": tid, "name": _thread_name(p.pid, tid),
                               "cpu_pct": round(100.0 * d / wall, 2)}
                              for d, tid in busy[:top_threads] if d > 0]
        rows.append(row)
    rows.sort(key=lambda r: (r["category"], -r["cpu_pct"]))
    totals = {c: round(sum(r["cpu_pct"] for r in rows if r["category"] == c), 2)
              for c in ("tetris", "serve", "ray")}
    return {"window_s": round(wall, 2), "processes": rows, "total_pct": totals,
            "all_pct": round(sum(totals.values()), 2)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start_server(config: str, port: int, log: Path, timeout_s: float,
                 extra: list[str] = (), env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``tetris serve`` (``env``: added to this environment) and wait for its URL."""
    proc = launch_server(config, port, log, extra, env)
    return proc, wait_ready(proc, log, timeout_s)


def launch_server(config: str, port: int, log: Path, extra: list[str] = (),
                  env: dict | None = None) -> subprocess.Popen:
    ready = log.with_suffix(".ready")
    ready.unlink(missing_ok=True)
    exe = shutil.which("tetris")
    cmd = [exe] if exe else [sys.executable, "-m", "tetris.cli.main"]
    cmd += ["serve", "--config", config, "--port", str(port), "--ready-file", str(ready), *extra]
    # In the caller's directory: Ray puts the driver's directory on its workers' sys.path.
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env=None if env is None else os.environ | env)


def wait_ready(proc: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """The URL a launched ``tetris serve`` writes to its ready file once it answers."""
    ready = log.with_suffix(".ready")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists() and ready.read_text().strip():
            return ready.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"tetris serve exited with {proc.returncode}; see {log}")
        time.sleep(0.5)
    raise TimeoutError(f"tetris serve not ready after {timeout_s:g}s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_floor(config: str, port: int, log: Path, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """The bare process graph of ``config``'s deployment (module docstring), in a child."""
    ready = log.with_suffix(".ready")
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--floor-child", "--config", config,
           "--port", str(port), "--ready-file", str(ready)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists() and ready.read_text().strip():
            return proc, ready.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"the floor app exited with {proc.returncode}; see {log}")
        time.sleep(0.5)
    raise TimeoutError(f"the floor app not ready after {timeout_s:g}s; see {log}")


def floor_child(config: str, port: int, ready_file: Path) -> int:
    """Serve the bare graph until SIGTERM (runs in the child ``start_floor`` starts)."""
    import asyncio

    from tetris.actors.process_env import SERVE_ENV_VARS, runtime_env

    from tetris.config import load_deployment

    for key, value in SERVE_ENV_VARS.items():   # as ``tetris serve`` does
        os.environ.setdefault(key, value)
    from tetris.serve import ray_idle

    ray_idle.apply(os.environ)                  # the same Ray timers as ``tetris serve``
    import ray
    from ray import serve

    dep = load_deployment(config)
    control = {"num_cpus": 0, "runtime_env": runtime_env(control=True)}

    @ray.remote(num_cpus=0)
    class Bare:
        def ping(self) -> int:
            return 1

    @serve.deployment(ray_actor_options=control)
    class BarePool:
        def __init__(self, n: int) -> None:
            self.actors = [Bare.options(runtime_env=runtime_env()).remote() for _ in range(n)]

        async def ping(self) -> int:
            return sum(await asyncio.gather(*[a.ping.remote() for a in self.actors]))

    @serve.deployment(ray_actor_options=control)
    class BareDispatcher:
        def __init__(self, prefill, decode) -> None:
            self.prefill, self.decode = prefill, decode

        async def ping(self) -> int:
            return await self.prefill.ping.remote() + await self.decode.ping.remote()

    @serve.deployment(ray_actor_options=control)
    class BareIngress:
        def __init__(self, dispatcher) -> None:
            self.dispatcher = dispatcher

        async def __call__(self, request) -> dict:
            return {"actors": await self.dispatcher.ping.remote()}

    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    ray.init(include_dashboard=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        ranks = dep.decode.num_instances * dep.decode.tp_size
        app = BareIngress.bind(BareDispatcher.bind(BarePool.bind(dep.prefill.num_instances),
                                                   BarePool.options(name="BareDecodePool").bind(ranks)))
        serve.run(app, name="idle-floor", route_prefix="/")
        # as ``tetris serve`` warms its dispatcher: a handle (and its router) in the driver
        serve.get_deployment_handle("BareDispatcher", "idle-floor").ping.remote().result()
        ready_file.write_text(f"http://127.0.0.1:{port}\n")
        while not stop:
            time.sleep(0.5)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _model_name(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def print_table(result: dict, limit: float, out=sys.stdout) -> None:
    print(f"{'category':<8} {'pid':>7} {'process':<34} {'user s':>8} {'sys s':>8} {'% core':>7}", file=out)
    for r in result["processes"]:
        print(f"{r['category']:<8} {r['pid']:>7} {r['name'][:34]:<34} {r['user_s']:>8.3f} "
              f"{r['system_s']:>8.3f} {r['cpu_pct']:>7.2f}{'  (new)' if r['new'] else ''}", file=out)
        for t in r.get("threads", []):
            print(f"{'':<8} {t['tid']:>7}   thread {t['name'][:25]:<25} {'':>8} {'':>8} {t['cpu_pct']:>7.2f}",
                  file=out)
    tot = result["total_pct"]
    print(f"over {result['window_s']:g} s: tetris {tot['tetris']:.2f}% of one core "
          f"(limit {limit:g}%), ray serve {tot['serve']:.2f}%, ray system {tot['ray']:.2f}%, "
          f"all {result['all_pct']:.2f}%", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny-cpu.toml"))
    ap.add_argument("--pid", type=int, default=None,
                    help="measure the process tree of this running `tetris serve` instead of starting one")
    ap.add_argument("--url", default=None, help="its URL, for the warm-up request (with --pid)")
    ap.add_argument("--port", type=int, default=0, help="port of the started server (default: a free one)")
    ap.add_argument("--prefill-check-s", type=float, default=None, metavar="S",
                    help="passed to the started `tetris serve` (its idle prefill probe period)")
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--settle-s", type=float, default=5.0,
                    help="wait after the warm-up request before measuring")
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--limit", type=float, default=5.0,
                    help="fail when tetris's processes use this percent of one core or more")
    ap.add_argument("--threads", type=int, default=0, metavar="N",
                    help="also list each process's N busiest threads")
    ap.add_argument("--floor", action="store_true",
                    help="also measure the same process graph with no Tetris code (module docstring)")
    ap.add_argument("--limit-over-floor", type=float, default=None, metavar="PCT",
                    help="with --floor: also fail when tetris's total exceeds the floor's by PCT")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--floor-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.floor_child:
        return floor_child(args.config, args.port, args.ready_file)

    proc = None
    log_dir = Path(tempfile.mkdtemp(prefix="tetris-idle-"))
    try:
        if args.pid is None:
            port = args.port or _free_port()
            extra = [] if args.prefill_check_s is None else ["--prefill-check-s", str(args.prefill_check_s)]
            proc, url = start_server(args.config, port, log_dir / "serve.log", args.start_timeout_s, extra)
            root = proc.pid
        else:
            root, url = args.pid, args.url
        warm = None
        if url:
            t0 = time.monotonic()
            body = {"model": _model_name(url), "prompt": "Tetris fills the gaps " * 20,
                    "max_tokens": 8, "temperature": 0}
            _post(f"{url}/v1/completions", body, timeout=120)
            warm = round(time.monotonic() - t0, 3)
        time.sleep(args.settle_s)
        result = measure(root, args.window_s, top_threads=args.threads)
        result.update(config=args.config, prefill_check_s=args.prefill_check_s,
                      warmup_request_s=warm, limit_pct=args.limit,
                      ok=result["total_pct"]["tetris"] < args.limit)
    finally:
        if proc is not None:
            stop_server(proc)
    if args.floor:
        fproc, furl = start_floor(args.config, _free_port(), log_dir / "floor.log", args.start_timeout_s)
        try:
            _post(furl, {}, timeout=120)   # every replica and actor called once
            time.sleep(args.settle_s)
            floor = measure(fproc.pid, args.window_s, top_threads=args.threads)
        finally:
            stop_server(fproc)
        over = round(result["total_pct"]["tetris"] - floor["total_pct"]["tetris"], 2)
        result.update(floor=floor, tetris_over_floor_pct=over)
        if args.limit_over_floor is not None:
            result.update(limit_over_floor_pct=args.limit_over_floor,
                          ok=result["ok"] and over < args.limit_over_floor)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result, args.limit)
        if "floor" in result:
            print("\nfloor: the same processes with no Tetris code")
            print_table(result["floor"], args.limit)
            print(f"tetris over the floor: {result['tetris_over_floor_pct']:+.2f}% of one core")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
