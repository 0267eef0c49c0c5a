"""Decode rounds of one TP decode instance, this tree beside an older one: the wall time of a
round as the driver sees it (Ray call(s) + lockstep + engine step) against rank 0's engine
step alone, so the round's overhead is what the lockstep costs.

Each run is this script in a fresh process with its own Ray instance; the runs alternate
between the trees (``--repeats`` times each) so that a noisy machine hits both alike. A
baseline tree is a git worktree; its packages are made importable from a symlinked package
tree (the repository maps ``tetris.actors`` to ``actors/`` and so on), put first on
PYTHONPATH for the run and its Ray workers.

    git worktree add /tmp/base_h1 <commit>
    python benchmarks/bench_decode_lockstep.py --baseline-root /tmp/base_h1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# where each subpackage of ``tetris`` lives in a checkout (pyproject's package-dir)
_PACKAGE_DIRS = {"actors": "actors", "transfer": "transfer", "kernels": "kernels",
                 "configs": "configs"}


def _package_tree(root: Path, into: Path) -> Path:
    """A ``tetris`` package of ``root``'s checkout under ``into``, made of symlinks."""
    pkg = into / "tetris"
    pkg.mkdir()
    for entry in sorted((root / "tetris").iterdir()):
        (pkg / entry.name).symlink_to(entry)
    for name, folder in _PACKAGE_DIRS.items():
        if not (pkg / name).exists():
            (pkg / name).symlink_to(root / folder)
    return into


async def _rounds(concurrency: int, prompt_tokens: int, max_tokens: int) -> dict:
    from tetris.actors.decode.instance import DecodeInstance
    from tetris.config import load_deployment
    from tetris.sampling_params import SamplingParams

    dep = load_deployment(None)
    inst = DecodeInstance(dep, 0, transfer=None)
    await inst.start()
    try:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

        async def one(i: int) -> int:
            prompt = [(j * 31 + i) % 500 + 3 for j in range(prompt_tokens)]
            await inst.add(f"r{i}", prompt, params)
            return len([t async for o in inst.stream(f"r{i}") for t in o.new_token_ids])

        await asyncio.gather(*[one(i) for i in range(2)])   # warm up
        inst.round_times.clear()
        inst.step_times.clear()
        tokens = await asyncio.gather(*[one(100 + i) for i in range(concurrency)])
        assert all(t == max_tokens for t in tokens), tokens
        rounds, steps = list(inst.round_times), list(inst.step_times)
    finally:
        await inst.shutdown()
    return {"round_p50_ms": 1e3 * statistics.median(rounds),
            "step_p50_ms": 1e3 * statistics.median(steps), "rounds": len(rounds)}


def _one_run(args) -> dict:
    import ray

    ray.init(num_cpus=32, include_dashboard=False, log_to_driver=False)
    try:
        return {c: asyncio.run(_rounds(c, args.prompt_tokens, args.max_tokens))
                for c in args.concurrency}
    finally:
        ray.shutdown()


def _spawn(args, root: Path | None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one-run",
           "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
           "--concurrency", *[str(c) for c in args.concurrency]]
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        if root is not None:
            path = _package_tree(root.resolve(), Path(tmp))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, check=False)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--baseline-root", type=Path, default=None,
                   help="an older checkout (a git worktree) to run beside this one")
    p.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.one_run:
        print(json.dumps(_one_run(args)))
        return 0
    trees = [("this tree", None)]
    if args.baseline_root is not None:
        trees.insert(0, ("baseline", args.baseline_root))
    rows = []
    for repeat in range(args.repeats):
        for label, root in trees:
            for c, r in _spawn(args, root).items():
                rows.append({"tree": label, "repeat": repeat, "concurrency": c, **r,
                             "overhead_ms": r["round_p50_ms"] - r["step_p50_ms"]})
    report = {"label": "CPU, tiny deployment's decode instance (TP 2), local prefill path",
              "rows": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    cols = ["tree", "repeat", "concurrency", "round_p50_ms", "step_p50_ms", "overhead_ms",
            "rounds"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
