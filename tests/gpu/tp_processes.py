"""TP prefill instances as processes, without Ray: what a TP prefill worker does, on any device.

``TPProcessPool(cfg, instances, tp, device)`` starts ``instances × tp`` processes; process
``(i, t)`` joins instance ``i``'s TP group (``tp_groups.join_instance_group``) and head slice
``t``'s world (``tp_groups.SliceWorld``), loads its model shard and a KV store on ``device``
and runs its instance's chunks of each plan through ``ModelExecutor``, as the worker actor does.
``run`` and ``kv`` have ``check_plan``'s shape (tests/cdsp_check.py). For the GPU machine,
where Ray is not installed.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
from types import SimpleNamespace

import torch

from tetris.actors.prefill.world import free_port

_TIMEOUT_S = 300.0


def _serve(i: int, t: int, tp: int, instances: int, cfg, device: str, ports, cmds, replies):
    from tetris.actors.collectives import rank_device
    from tetris.actors.prefill.chunks import RunOptions, chunk_task
    from tetris.actors.prefill.executor import ModelExecutor
    from tetris.actors.prefill.kv_store import PagedKVStore
    from tetris.actors.prefill.layout import plan_layout
    from tetris.actors.prefill.tp_groups import SliceWorld, join_instance_group
    from tetris.model.loader import load_model
    from tetris.token_ids import compact_tokens

    try:
        torch.set_num_threads(1)
        group = join_instance_group("127.0.0.1", ports[i], t, tp, device)
        model = load_model(cfg, tp_group=group, device=device)[0]
        store = PagedKVStore(model.num_layers, 256, 16, model.local_num_kv_heads,
                             model.head_dim, dtype=model.dtype, device=device)
        executor = ModelExecutor(model, store)
        world = SliceWorld(0, "127.0.0.1", ports[-1], i, instances, _TIMEOUT_S, t,
                           device=rank_device(device))
        replies.put((i, t, "ready", world.backend))
        seq = 0
        while True:
            cmd, *args = cmds.get()
            if cmd == "stop":
                return
            if cmd == "kv":
                pos, k, v = store.export(args[0])
                replies.put((i, t, "kv", (pos.cpu(), k.cpu(), v.cpu())))
                continue
            plan, ids, balance = args
            opts = RunOptions(balance, None, True, (), None, None)
            layouts, _final = plan_layout(plan, balance)
            out = SimpleNamespace(first_token=None, logits=None, balance_moved_tokens=0)
            with torch.inference_mode():
                for k, lay in enumerate(layouts):
                    seq += 1
                    if i not in lay.group:
                        continue
                    task = chunk_task(plan, k, lay.group.index(i), lay, compact_tokens(ids), seq,
                                      opts, 0, timeout_s=_TIMEOUT_S, emulated=False)
                    executor.prepare(task)
                    res = executor.execute(task, world)
                    out.balance_moved_tokens += res.balance_sent_tokens
                    if res.first_token is not None:
                        out.first_token, out.logits = res.first_token, res.logits
            replies.put((i, t, "run", out))
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        replies.put((i, t, "error", f"{type(e).__name__}: {e}"))


class TPProcessPool:
    def __init__(self, cfg, instances: int, tp: int, device: str) -> None:
        ctx = mp.get_context("spawn")
        self.instances, self.tp = instances, tp
        ports = [free_port() for _ in range(instances + 1)]
        self.replies = ctx.Queue()
        self.cmds = {(i, t): ctx.Queue() for i in range(instances) for t in range(tp)}
        self.procs = [ctx.Process(target=_serve, args=(i, t, tp, instances, cfg, device, ports,
                                                       q, self.replies), daemon=True)
                      for (i, t), q in self.cmds.items()]
        for p in self.procs:
            p.start()
        self.backends = {a[3] for a in self._gather(self.cmds)}

    def _gather(self, ranks) -> list:
        got = []
        for _ in ranks:
            try:
                got.append(self.replies.get(timeout=_TIMEOUT_S))
            except queue_mod.Empty:
                raise TimeoutError("a TP prefill process did not answer") from None
            if got[-1][2] == "error":
                raise RuntimeError(f"rank {got[-1][:2]}: {got[-1][3]}")
        return sorted(got, key=lambda a: a[:2])

    def run(self, plan, ids, *, return_logits: bool = True, balance: str = "overlap"):
        for q in self.cmds.values():
            q.put(("run", plan, list(ids), balance))
        outs = [a[3] for a in self._gather(self.cmds)]
        # every TP rank samples the same first token; the pool counts TP rank 0's balancing
        firsts = [o for o in outs if o.first_token is not None]
        assert len({o.first_token for o in firsts}) == 1 and len(firsts) == self.tp
        leaders = outs[::self.tp]
        return SimpleNamespace(first_token=firsts[0].first_token, logits=firsts[0].logits,
                               balance_moved_tokens=sum(o.balance_moved_tokens for o in leaders))

    def kv(self, request_id: str, instance: int):
        """(positions, k, v) of ``instance``: its ranks' head slices side by side."""
        from tetris.actors.prefill.tp_groups import concat_heads

        ranks = [(instance, t) for t in range(self.tp)]
        for r in ranks:
            self.cmds[r].put(("kv", request_id))
        return concat_heads([a[3] for a in self._gather(ranks)])

    def close(self) -> None:
        for q in self.cmds.values():
            q.put(("stop",))
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
