"""The live half of ``tetris bench fidelity``: an emulated Serve app driven open-loop.

``LiveCluster`` starts Ray (unless the caller has), Serve and the app of a deployment, wires it
(``DispatcherServer.warmup``) and tears it down on exit. ``run_trace`` sends each request of a
trace at its arrival time (× the time scale) through the Ingress handle's ``generate_stream``,
without waiting for earlier ones (open loop), and returns per-request times plus the control
counters of the decode ranks and the dispatcher's timelines.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

from tetris.config import DeploymentConfig

__all__ = ["LiveCluster", "start_ray"]

_PROMPT_TOKEN = 1000   # any id inside the vocabulary: emulated workers never read the prompt


def start_ray() -> None:
    """A local Ray for emulated apps: more logical CPUs than cores (emulated actors mostly
    wait), one OpenMP thread per process, no dashboard."""
    import ray

    ray.init(num_cpus=64, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})


class LiveCluster:
    def __init__(self, deployment: DeploymentConfig, *, app_name: str = "tetris") -> None:
        self.deployment = deployment
        self.app_name = app_name
        self.started_ray = False
        self.startup_s = 0.0

    def __enter__(self) -> LiveCluster:
        import ray
        from ray import serve

        from tetris.serve.app import build_app

        t0 = time.perf_counter()
        if not ray.is_initialized():
            start_ray()
            self.started_ray = True
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        self.ingress = serve.run(build_app(self.deployment, max_pending=4096),
                                 name=self.app_name, route_prefix=f"/{self.app_name}")
        self.dispatcher = serve.get_deployment_handle("DispatcherServer", self.app_name)
        self.decode = serve.get_deployment_handle("DecodePoolServer", self.app_name)
        self.dispatcher.warmup.remote().result(timeout_s=600)
        self.ranks = [h for _rid, (h, _info) in sorted(self.decode.peers.remote().result().items())]
        self.startup_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        try:
            serve.delete(self.app_name)
        finally:
            if self.started_ray:
                serve.shutdown()
                ray.shutdown()

    def counts(self) -> dict[str, int]:
        import ray

        total: dict[str, int] = {}
        for c in ray.get([r.control_counts.remote() for r in self.ranks]):
            for k, v in c.items():
                total[k] = total.get(k, 0) + v
        return total

    def held(self) -> dict:
        return self.dispatcher.held.remote().result(timeout_s=60)

    def prompt_of(self, r) -> tuple[int, ...]:
        """The prompt's token ids: emulated workers never read them, so one id repeated
        (a workload with shared prefixes gives each its own, ``prefix_live.py``)."""
        return (_PROMPT_TOKEN,) * r.prompt_tokens

    async def send_one(self, r, request_id: str) -> dict:
        """One request of a trace through the ingress handle's stream: when it was sent and
        its first token came (``perf_counter``), tokens received and the error, if any. A
        request fails on an exception or when fewer tokens than asked arrive."""
        from tetris.sampling_params import SamplingParams
        from tetris.serve.types import GenerationRequest

        sent = time.perf_counter()
        req = GenerationRequest(prompt_token_ids=self.prompt_of(r),
                                request_id=request_id,
                                sampling=SamplingParams(max_tokens=r.output_tokens,
                                                        temperature=0, ignore_eos=True))
        first, tokens, err = None, 0, None
        try:
            async for d in self.ingress.options(stream=True).generate_stream.remote(req):
                if first is None and d.new_token_ids:
                    first = time.perf_counter()
                tokens += len(d.new_token_ids)
        except asyncio.CancelledError:
            err = "cancelled before it finished"
        except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
            err = f"{type(e).__name__}: {e}"
        if err is None and tokens < r.output_tokens:
            err = f"{tokens} of {r.output_tokens} tokens"
        return {"request_id": request_id, "sent": sent, "first": first, "tokens": tokens,
                "error": err}

    async def run_trace(self, trace, time_scale: float,
                        tick: Callable[[int], None] | None = None) -> dict:
        before = self.counts()
        t0 = time.perf_counter() + 0.05
        out: list[dict] = []

        async def one(i: int, r) -> None:
            due = t0 + r.arrival_time * time_scale
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            got = await self.send_one(r, f"fid-{r.request_id}-{int(t0 * 1e3)}")
            first = got["first"]
            out.append(got | {"i": i, "lag": got["sent"] - due,
                              "ttft": None if first is None else (first - got["sent"]) / time_scale})
            if tick is not None:
                tick(1)

        await asyncio.gather(*[one(i, r) for i, r in enumerate(trace)])
        after = self.counts()
        timelines = await self.dispatcher.timelines.remote(len(trace) + 64)
        return self._collect(trace, out, before, after, timelines, time_scale)

    def _collect(self, trace, out, before, after, timelines, time_scale) -> dict:
        out.sort(key=lambda o: o["i"])
        by_id = {t["request_id"]: t for t in timelines}
        failed = [o for o in out if o["error"]]
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        tls = [by_id[o["request_id"]] for o in out if o["request_id"] in by_id]
        return {
            "ttft_s": [o["ttft"] if o["ttft"] is not None else float("nan") for o in out],
            # The dispatcher's own view: arrival there to the end of the prefill (the
            # simulator's TTFT definition), without ingress hops and the decode hand-off.
            "prefill_ttft_s": [(t["prefill_end"] - t["arrival"]) / time_scale for t in tls],
            "to_plan_s": [t["planned"] - t["arrival"] for t in tls],
            "handoff_s": [t["first_output"] - t["prefill_end"] for t in tls if t["first_output"]],
            # How late each prefill ended against its plan's TTFT estimate (a duration from the
            # planning instant): the live pool's execution overhead (Ray calls, turn-taking)
            # and the queue's corrections.
            "overrun_s": [t["prefill_end"] - t["planned"] - t["ttft_estimate"] for t in tls
                          if t["ttft_estimate"]],
            "chunk_member_calls": 2 * sum(sum(t["sp_sizes"]) for t in tls),
            "transfer_calls": delta.get("transfer_calls_in", 0) + delta.get("transfer_calls_out", 0),
            "decode_steps": delta.get("steps", 0),
            "messages": {k: v for k, v in delta.items() if ":" in k},
            "lag_s": [o["lag"] for o in out],
            "timelines": tls,   # the dispatcher's timelines of this trace's requests
            "timelines_by_index": {o["i"]: by_id[o["request_id"]] for o in out
                                   if o["request_id"] in by_id},
            "failed": len(failed),
            "errors": sorted({o["error"] for o in failed if o["error"]})[:5],
        }
