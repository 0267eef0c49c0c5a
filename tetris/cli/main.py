"""Entry point of the ``tetris`` command.

Each subcommand lives in its own module of ``tetris.cli`` that defines
``register(subparsers) -> None``; the module adds its parser and sets ``func(args) -> int``.
Modules are imported only when their command runs (``tetris sim`` never imports torch).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# command name -> (module, one-line help). Add a line here to add a command.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("tetris.cli.generate", "generate a completion for one prompt"),
    "sim": ("tetris.cli.sim", "discrete-event simulation: run, sweep, capacity, profile-rate, figures"),
    "plan": ("tetris.cli.plan", "show the prefill plan (chunks, groups, times) of one request"),
    "profile": ("tetris.cli.profile", "fit or show prefill latency profiles (paper Eq. 1)"),
    "serve": ("tetris.cli.serve", "start Ray and serve the OpenAI-compatible API (Ray Serve)"),
    "bench": ("tetris.cli.bench", "benchmarks measured side by side (transfer, ...)"),
}


def _parser(selected: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tetris",
        description="Tetris: long-context LLM serving with chunkwise dynamic sequence parallelism.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if name == selected:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    parser = _parser(selected if selected in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`tetris ... | head`): end quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
