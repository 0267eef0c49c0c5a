"""Decode instances: the driver (``instance``), its TP rank actors and the emulated engine."""
