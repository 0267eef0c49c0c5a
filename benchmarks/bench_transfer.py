"""KV transfer benchmark, same as ``tetris bench transfer``; kept here with the other scripts.

    OMP_NUM_THREADS=1 python benchmarks/bench_transfer.py --json
"""

from __future__ import annotations

import sys

from tetris.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "transfer", *sys.argv[1:]]))
