"""Ray actors: prefill workers of the SP pool and decode instances (TP groups)."""
