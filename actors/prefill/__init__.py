"""The SP prefill pool: the driver (``pool``, ``worlds``, ``wiring``), its worker actors and what they run."""
