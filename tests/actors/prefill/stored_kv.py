"""A pool plan's stored KV against the single instance's within fp32 rounding: tighter than
``check_plan``'s KV tolerance (tests/cdsp_check.py), for layouts that must not lose bits."""

from __future__ import annotations

import torch
from cdsp_check import reference


def assert_stored_kv_within_fp32(pool, model, plan, ids) -> None:
    """Every member's stored K and V at its positions equal the reference's up to rounding."""
    _, ref_k, ref_v = reference(model, ids)
    for inst in plan.instances:
        p, k, v = pool.kv(plan.request_id, inst)
        torch.testing.assert_close(k, ref_k[:, p], rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(v, ref_v[:, p], rtol=1e-4, atol=2e-5)
