"""Prefill planning: latency models, CDSP (Algorithms 1-3), baselines, decode routing, improvement rate."""
