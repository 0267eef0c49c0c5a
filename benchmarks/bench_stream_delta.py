"""What one streamed token costs a serving hop: a cumulative ``RequestOutput`` against an
``OutputDelta``, at several output lengths, side by side in one run.

Every hop of the token path (decode ranks -> decode instance -> dispatcher -> ingress) pickles
each item on one side and unpickles it on the other. A cumulative output repeats every token
and all the text so far, so its cost grows with the output; a delta's does not. Measured here:
the pickle round trip (protocol 5, as Ray uses) and the bytes of one item, for the item after
``n`` output tokens (text ~4 characters a token).

    python benchmarks/bench_stream_delta.py
    python benchmarks/bench_stream_delta.py --lengths 256,2048,8192,32768 --json

The ratio is what to read; the absolute times are this machine's.
"""

from __future__ import annotations

import argparse
import json
import pickle
import timeit

from tetris.engine.request import OutputDelta, RequestOutput


def _round_trip_us(obj, number: int, repeat: int) -> float:
    def once():
        pickle.loads(pickle.dumps(obj, protocol=5))
    return min(timeit.repeat(once, number=number, repeat=repeat)) / number * 1e6


def measure(lengths: list[int], number: int = 200, repeat: int = 5) -> list[dict]:
    rows = []
    for n in lengths:
        ids = tuple(1000 + (7919 * i) % 120_000 for i in range(n))
        text = "word" * n
        cumulative = RequestOutput("req-0", (), ids, ids[-1:], text, text[-4:], False)
        delta = OutputDelta.of(cumulative)
        assert delta.num_tokens == n and delta.new_token_ids == ids[-1:]
        cum_us = _round_trip_us(cumulative, number, repeat)
        delta_us = _round_trip_us(delta, number, repeat)
        rows.append({"output_tokens": n, "cumulative_us": cum_us, "delta_us": delta_us,
                     "ratio": cum_us / delta_us,
                     "cumulative_bytes": len(pickle.dumps(cumulative, protocol=5)),
                     "delta_bytes": len(pickle.dumps(delta, protocol=5))})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="256,2048,8192", help="output lengths, comma-separated")
    p.add_argument("--number", type=int, default=200, help="round trips per timing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if not lengths or min(lengths) <= 0:
        p.error("--lengths must be positive integers")
    rows = measure(lengths, args.number)
    if args.json:
        print(json.dumps({"benchmark": "stream_delta", "rows": rows}))
        return
    print("per streamed item and hop: pickle round trip (protocol 5) and size")
    print(f"{'output tokens':>13} {'cumulative':>12} {'delta':>9} {'ratio':>7} {'bytes cum.':>11} {'bytes delta':>11}")
    for r in rows:
        print(f"{r['output_tokens']:>13} {r['cumulative_us']:>10.1f}us {r['delta_us']:>7.1f}us "
              f"{r['ratio']:>6.1f}x {r['cumulative_bytes']:>11} {r['delta_bytes']:>11}")


if __name__ == "__main__":
    main()
