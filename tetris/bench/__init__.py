"""Measured benchmarks and diagnostics, the library side of ``tetris bench``.

``fidelity`` (the emulated live app against the simulator; ``fidelity_live`` drives the app),
``policies`` (the policies ranked live and simulated), ``soak`` (a long open-loop run: failures
and actor memory; ``soak_memory`` and ``heap_probe`` look inside the processes), ``chaos``
(workers killed under load), ``transfer`` (KV streaming throughput and handshake cost).

Each takes its values as parameters and returns one JSON-ready dict; the command line
(``tetris/cli/bench*.py``) parses the arguments and prints. Nothing here imports ``tetris.cli``,
and only the CLI imports this package (tests/test_layering.py).
"""
