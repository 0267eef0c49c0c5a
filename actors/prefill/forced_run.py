"""``tetris generate --plan SPEC``: prefill one prompt on the SP pool with a forced chunk plan.

A debugging path for CDSP prefill: the prompt is prefilled chunk by chunk on a local pool of
prefill workers (``[prefill]`` of the deployment; groups grown by the scheduler's ``extend``),
the worker holding the last prompt token samples the first token, and the single-instance
engine continues the completion from ``prompt + [first token]`` (it recomputes the prompt's KV:
there is no decode instance to hand the pool's KV to in this command). A summary of the prefill
(chunks, groups, times, balancing traffic, final KV layout) goes to stderr, so stdout stays the
completion alone (or one JSON object with ``--json``).

Seeded sampling agrees with a plain ``tetris generate`` run with the same seed: every draw is
keyed by (seed, position) (engine/sampling.py), whoever makes it.
"""

from __future__ import annotations

import sys

import msgspec

from tetris.sampling_params import SamplingParams

__all__ = ["generate_with_plan"]


def _deployment(args):
    from tetris.config import DeploymentConfig, load_deployment
    from tetris.model.loader import model_config_for_path

    if getattr(args, "model", None) is not None:   # a .gguf file or an HF directory
        return DeploymentConfig(model=model_config_for_path(args.model))
    return load_deployment(getattr(args, "config", None))


def prefill_with_plan(deployment, prompt: list[int], spec: str, params: SamplingParams):
    """Run the forced plan on a fresh local pool; returns the ``PrefillResult``."""
    import ray

    from tetris.actors.prefill.layout import forced_plan
    from tetris.actors.prefill.pool import PrefillPool

    pc = deployment.prefill
    # Build (and check) the plan before any actor starts: a bad spec fails fast.
    node_of = tuple(i // pc.node_size for i in range(pc.num_instances))
    plan = forced_plan("generate-plan", len(prompt), spec, node_of,
                       num_kv_heads=deployment.model.num_kv_heads // pc.tp_size)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=max(8, deployment.prefill.num_instances), include_dashboard=False,
                 log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    pool = None
    try:
        pool = PrefillPool(deployment)
        result = pool.run(plan, prompt, sampling=params)
        pool.release(plan.request_id)
        return plan, result
    finally:
        if pool is not None:
            pool.shutdown()
        if started:
            ray.shutdown()


def generate_with_plan(args, prompt: list[int], params: SamplingParams, tokenizer, make_engine):
    """Prefill on the pool, continue on the engine; returns an engine ``RequestOutput``."""
    from tetris.engine.request import RequestOutput

    from tetris.actors.prefill.messages import PrefillError

    try:
        plan, res = prefill_with_plan(_deployment(args), prompt, args.plan, params)
    except PrefillError as e:  # the CLI reports bad plans and failed prefills alike (exit 2)
        raise ValueError(f"--plan prefill failed: {e}") from None
    print(_summary(plan, res), file=sys.stderr)
    first = res.first_token
    tokens, text, reason = [first], None, None
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos
                                          else set(tokenizer.eos_token_ids))
    if first in stops:
        tokens, text, reason = [], "", "stop"
    elif params.max_tokens == 1:
        reason = "length"
    else:
        rest = msgspec.structs.replace(params, max_tokens=params.max_tokens - 1)
        out = make_engine(len(prompt) + params.max_tokens).generate([prompt + [first]], rest)[0]
        tokens += list(out.token_ids)
        reason = out.finish_reason
    if text is None:
        text = tokenizer.decode(tokens)
    return RequestOutput(request_id=plan.request_id, prompt_token_ids=tuple(prompt),
                         token_ids=tuple(tokens), new_token_ids=tuple(tokens), text=text,
                         new_text=text, finished=True, finish_reason=reason)


def _summary(plan, res) -> str:
    lines = [f"CDSP prefill of {plan.prompt_tokens} tokens in {res.elapsed_s:.3f}s"
             f"{' (EMULATED)' if res.emulated else ''}; first token {res.first_token}; "
             f"balancing moved {res.balance_moved_tokens} tokens, "
             f"waited {res.balance_wait_s:.4f}s"]
    for k, (c, t) in enumerate(zip(plan.chunks, res.chunk_elapsed_s)):
        lines.append(f"  chunk {k}: [{c.start}, {c.end}) on instances {list(c.instances)}: "
                     f"{t:.3f}s, {c.sp_layout}"
                     + (f" ({c.sp_layout_reason})" if c.sp_layout_reason else ""))
    lines.append("  KV held: " + ", ".join(
        f"instance {i}: {sum(hi - lo for lo, hi in r)} tokens" for i, r in res.kv_layout))
    return "\n".join(lines)
