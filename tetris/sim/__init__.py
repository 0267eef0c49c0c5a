"""Discrete-event simulator of a prefill/decode disaggregated cluster (no torch, no ray)."""
