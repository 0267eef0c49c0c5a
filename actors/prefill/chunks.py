"""One chunk of a plan on its members, for the chunk driver (``pool.PrefillPool``): the task each
member gets, a phase (``prepare``, then ``execute``) run on every member with the root cause of
a failure named first, and the request's result from its chunks' answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from tetris.actors.prefill.messages import (
    BalanceMode,
    ChunkResult,
    ChunkTask,
    PrefillError,
    PrefillResult,
    PrefillWorkerLost,
    first_line,
)
from tetris.config import CsaConfig
from tetris.kernels.csa import level_drop_ratios
from tetris.plan import PrefillPlan
from tetris.sampling_params import SamplingParams
from tetris.token_ids import TokenIds, token_slices

__all__ = ["ChunkFailed", "RunOptions", "chunk_task", "prefill_result", "run_phase"]


class RunOptions(NamedTuple):
    """How ``PrefillPool.run`` runs one request's chunks."""

    balance: BalanceMode
    sampling: SamplingParams | None
    return_logits: bool
    kv_receivers: tuple[int, ...]
    on_chunk_start: Callable[[int], None] | None
    on_chunk_end: Callable[[int, bool], None] | None
    # False: the decode instance has the cached prefix already (prefix caching's decode side)
    prefix_streamed: bool = True
    kv_ranges: tuple = ()   # elastic decode: KVRange targets (actors/prefill/range_stream.py)
    csa: CsaConfig | None = None   # [csa]: LOSSY sparse attention in ring chunks (csa_ring.py)


class ChunkFailed(Exception):
    """A phase failed on some member; ``error`` is what the caller of ``run`` gets."""

    def __init__(self, method: str, group_size: int, errors: list, handles: dict,
                 error: PrefillError):
        super().__init__(str(error))
        self.method, self.group_size, self.errors, self.error = method, group_size, errors, error
        self.handles = handles   # instance -> the worker actor the chunk was sent to


def chunk_task(plan: PrefillPlan, k: int, r: int, lay, token_ids: TokenIds, seq: int,
               opts: RunOptions, world: int, *, timeout_s: float, emulated: bool,
               node_of: Sequence[int] = ()) -> ChunkTask:
    """What member ``r`` of chunk ``k`` (layout ``lay``) runs, on world generation ``world``."""
    c = plan.chunks[k]
    balance = opts.balance
    mine = lay.chunk_positions[r]
    csa = opts.csa if opts.csa is not None and opts.csa.enabled and c.sp_layout == "ring" else None
    return ChunkTask(
        request_id=plan.request_id, chunk_index=k, num_chunks=len(plan.chunks), seq=seq,
        group=lay.group, rank=r, chunk_start=c.start, chunk_end=c.end,
        prompt_tokens=plan.prompt_tokens, chunk_positions=lay.chunk_positions,
        history=lay.history, moves=lay.moves if balance != "off" else (),
        token_ids=member_tokens(token_ids, mine, emulated), balance=balance,
        sampling=opts.sampling, return_logits=opts.return_logits, timeout_s=timeout_s,
        kv_receivers=opts.kv_receivers, world=world, sp_layout=c.sp_layout,
        sp_micro_partitions=c.sp_micro_partitions, sp_layout_delta_s=c.sp_layout_delta_s,
        kv_ranges=opts.kv_ranges,
        sp_member_nodes=(tuple(node_of[i] for i in lay.group)
                         if node_of and (c.sp_layout == "sptp" or csa) else ()),
        csa_drop_ratios=(level_drop_ratios(csa.level2_drop_ratio, csa.level3_drop_ratio)
                         if csa else ()),
        csa_drop_queries=csa.drop_queries if csa else True,
    )


def member_tokens(token_ids: TokenIds, mine, emulated: bool) -> TokenIds:
    """A member's share of the prompt: its chunk slice as int32, none for an emulated
    executor (it computes nothing from token values)."""
    return TokenIds("i") if emulated else token_slices(token_ids, mine)


def run_phase(plan: PrefillPlan, k: int, tasks: list[ChunkTask], handles: list, method: str,
              *, timeout_s: float, node_of: Sequence[int]) -> list[ChunkResult]:
    """Run ``method`` on every member (``handles``, in task order); on failure name the
    root-cause worker."""
    import ray   # here, not at the top: chunk_task runs where Ray is not installed (GPU tests)

    refs = [getattr(h, method).remote(t) for h, t in zip(handles, tasks)]
    done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    out, errors = [], []
    for t, ref in zip(tasks, refs):
        if ref in pending:
            errors.append((t, TimeoutError(f"no answer in {timeout_s}s")))
            continue
        try:
            out.append(ray.get(ref))
        except Exception as e:  # noqa: BLE001 - every failure becomes a PrefillError
            errors.append((t, getattr(e, "cause", None) or e))
    if errors:
        # Peers of a failed worker time out or lose their gloo connection to it: report the
        # root cause first.
        errors.sort(key=lambda te: is_secondary(te[1]))
        t, err = errors[0]
        others = ", ".join(str(e[0].instance) for e in errors[1:])
        # a dead member is replaced (``PrefillPool._recover``) before the caller sees the error
        lost = any(isinstance(e, ray.exceptions.RayActorError) for _t, e in errors)
        raise ChunkFailed(method, len(tasks), [(e[0].instance, e[1]) for e in errors],
                          {t.instance: handle for t, handle in zip(tasks, handles)},
                          (PrefillWorkerLost if lost else PrefillError)(
            f"request {plan.request_id} chunk {k} failed on prefill instance {t.instance} "
            f"(node {node_of[t.instance]}) during {method}: {type(err).__name__}: "
            f"{first_line(err)}" + (f"; also failed: instances {others}" if others else "")
        ))
    return out


def prefill_result(plan: PrefillPlan, results: list[list[ChunkResult]], final: dict,
                   elapsed: float, waits: list[float], *, emulated: bool) -> PrefillResult:
    """The request's result from its chunks' answers (``results``, chunk by chunk)."""
    last = [r for r in results[-1] if r.first_token is not None or r.emulated]
    first = last[0] if last else None
    return PrefillResult(
        request_id=plan.request_id,
        first_token=first.first_token if first else None,
        logits=first.logits if first else None,
        first_logprob=first.first_logprob if first else None,
        first_token_streamed=any(r.first_token_streamed for r in results[-1]),
        elapsed_s=elapsed,
        chunk_elapsed_s=tuple(max(r.elapsed_s for r in rs) for rs in results),
        balance_wait_s=sum(max(r.balance_wait_s for r in rs) for rs in results),
        balance_moved_tokens=sum(r.balance_sent_tokens for rs in results for r in rs),
        kv_layout=tuple(sorted(final.items())),
        emulated=emulated,
        queued_s=waits[0],
        turn_wait_s=sum(waits[1:]),
        sent_elements=sum(r.sent_elements for rs in results for r in rs),
    )


_SECONDARY = ("imed out", "Connection closed by peer", "Connection reset by peer")


def is_secondary(err: BaseException) -> bool:
    """An error a ring peer sees because another member failed, not a root cause."""
    return isinstance(err, TimeoutError) or any(m in str(err) for m in _SECONDARY)
