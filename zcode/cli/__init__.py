"""The `zcode` command line: generate, chat, info, ppl and quantize over the `LLM` API, and serve.

User mistakes (a bad flag value, a missing file, a checkpoint we cannot read) end with one line
`zcode: error: ...` on stderr and exit status 2; Ctrl-C exits 130 without a traceback.
"""

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from zcode.cli import generate, measure, plan, quantize, serve
from zcode.errors import CheckpointError, RankFailure, ValidationError


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, like every other user mistake."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"zcode: error: {message} (see '{self.prog} --help')\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("zcode")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="zcode",
        description="ZCode: run, inspect and measure GLM-family and Llama-style models on CPU.",
    )
    parser.add_argument("--version", action="version", version=f"zcode {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for command_module in (generate, measure, quantize, serve, plan):
        command_module.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (CheckpointError, ValidationError) as e:
        print(f"zcode: error: {e}", file=sys.stderr)
        sys.exit(2)  # argparse's status for a usage error: one status for every user mistake
    except RankFailure as e:  # another torchrun rank died or hung
        print(f"zcode: error: {e}", file=sys.stderr)
        sys.exit(1)
    except NotImplementedError as e:  # an option this model or build does not support yet
        print(f"zcode: error: not supported yet: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        # The reader (`| head`) went away: silence the flush Python retries at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
