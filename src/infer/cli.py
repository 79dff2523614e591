"""The `infer` command. Each subcommand lives with its concern and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

# subcommand -> module exposing `register(subparsers)`; each sets `func` on its parser.
SUBCOMMANDS = {
    "serve": "infer.server.cli",
    "generate": "infer.generate_cli",
    "train": "infer.builtin.cli",
    "plan": "infer.plan",
    "bench": "infer.bench.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer", description="LLM inference serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C where a command has no handler of its own: no traceback
        print(f"\ninfer {args.command}: interrupted", file=sys.stderr)  # (after a progress bar)
        # End by SIGINT, as an uncaught Ctrl-C does, so a calling shell's loop stops too.
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130  # (only where the signal could not end the process)


if __name__ == "__main__":
    sys.exit(main())
