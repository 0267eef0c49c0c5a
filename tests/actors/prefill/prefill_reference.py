"""Single-instance prefill, the reference every pool plan is compared with (tests/cdsp_check.py)."""

from __future__ import annotations

from cdsp_check import prompt, reference

__all__ = ["prompt", "reference"]
