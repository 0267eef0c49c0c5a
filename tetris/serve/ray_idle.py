"""Ray and Ray Serve timer settings for a quieter idle server (issue #20: idle CPU).

``tetris serve`` sets these in its own environment before it starts Ray, so the Ray it starts
(gcs_server, raylet, dashboard agent, log monitor) and every worker the raylet spawns (Serve's
controller and proxy, the replicas, the prefill workers and decode ranks) inherit them. A value
already in the environment wins; ``TETRIS_RAY_IDLE_DEFAULTS=1`` keeps Ray's own defaults
(``benchmarks/bench_idle_cpu.py --compare`` measures both side by side).

Each entry lengthens a period that only matters while nothing happens, or turns off a poll
that has an event-driven twin in Ray; none of them is a failure detector Tetris relies on:
a dead worker process is seen by its raylet through its socket at once (not by a timer),
Serve's replica health checks keep their period, GCS keeps its node health checks, and the
supervisor's probes (``tetris/serve/supervisor.py``) are untouched. Measured per process in
docs/benchmarks.md, "Idle CPU".

What this cannot reach: every Ray worker process's main thread wakes every 10 ms to check for
signals (``CoreWorker.CheckSignal`` in ``RunTaskExecutionLoop``, a literal in Ray's C++, on a
timerfd, which timer slack does not stretch), and Ray's gRPC pollers' fixed deadlines.
"""

from __future__ import annotations

from collections.abc import MutableMapping

__all__ = ["DEFAULTS_SWITCH", "RAY_IDLE_ENV_VARS", "apply"]

DEFAULTS_SWITCH = "TETRIS_RAY_IDLE_DEFAULTS"

# name -> (value, Ray's default, what it slows down)
_SETTINGS: dict[str, tuple[str, str, str]] = {
    # Serve's controller reconciles every 0.1 s, idle or not (~1.6% of a core on the 2-core
    # VM). Replica health checks keep their own period (10 s); a replica that dies is replaced
    # at the next loop, at most 1 s later instead of 0.1 s.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": ("1.0", "0.1", "controller loop"),
    # Ray's per-handler timing statistics around every event-loop callback in every C++
    # component (the 10 ms signal check included); only printed in debug dumps.
    "RAY_event_stats": ("0", "1", "event stats"),
    # Ray's own metrics (OpenTelemetry export from every process to the dashboard agent, and
    # the GCS's and raylet's): Tetris serves its metrics from its own Prometheus registry
    # (``tetris/serve/metrics.py``); set it to 1 to scrape Ray's and Serve's internal ones.
    "RAY_enable_metrics_collection": ("0", "1", "Ray metrics"),
    # The raylet's memory monitor reads cgroup/proc memory every 250 ms to pick OOM victims;
    # 1 s still catches a leak long before it fills memory.
    "RAY_memory_monitor_refresh_ms": ("1000", "250", "memory monitor"),
    # The dashboard agent polls the raylet's pid every 0.4 s to exit with it; Ray's own
    # alternative blocks on a pipe from the raylet instead.
    "RAY_enable_pipe_based_agent_to_parent_health_check": ("1", "0", "agent parent check"),
    # The agent's reporter walks every process with psutil every 5 s for the dashboard,
    # which ``tetris serve`` does not start (``include_dashboard=False``).
    "REPORTER_UPDATE_INTERVAL_MS": ("60000", "5000", "reporter"),
    # The log monitor globs the log directory every 0.1 s while it holds < 1000 files;
    # these make it glob every 5 s (new workers' output reaches the driver up to 5 s later).
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": ("0", "1000", "log monitor glob"),
    "LOG_NAME_UPDATE_INTERVAL_S": ("5", "0.5", "log monitor glob"),
    # gloo's transport thread wakes every 10 ms; 50 ms of timer slack lets the kernel fold
    # those idle ticks (data still wakes it at once; actors/timer_slack.py says what waits).
    "TETRIS_GLOO_TIMER_SLACK_MS": ("50", "0", "gloo idle ticks"),
}

RAY_IDLE_ENV_VARS = {name: value for name, (value, _, _) in _SETTINGS.items()}


def apply(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set the idle settings in ``environ`` where unset (none when ``DEFAULTS_SWITCH`` is 1);
    returns what it set."""
    if environ.get(DEFAULTS_SWITCH, "0") == "1":
        return {}
    added = {k: v for k, v in RAY_IDLE_ENV_VARS.items() if k not in environ}
    environ.update(added)
    return added
