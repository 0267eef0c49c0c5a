"""Ray actors: ``prefill`` (the SP pool's driver and workers) and ``decode`` (decode instances,
TP groups); the modules both share (placement, process environment, transfer pump) sit here."""
