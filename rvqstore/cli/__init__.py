"""The ``rvqstore`` command line: :func:`main` and the parser built from the registered subcommands.

Imports read one way: this package imports the command modules (which register themselves in
:mod:`.registry`); a command module imports its siblings (:mod:`.registry`, :mod:`.options`, ...),
never this file.

- :mod:`.file_commands`: ``inspect``, ``verify`` (header / checksums of a ``.rvq`` file)
- :mod:`.prompt_commands`: ``cache-prompt``, ``generate`` (run a model; ``generate --store`` in
  :mod:`.store_generate`)
- :mod:`.demo`: ``demo``
- :mod:`.store_commands`: ``store ls | du | gc | verify``
- :mod:`.serve`: ``serve`` (mlx-lm's server with a store-backed prompt cache)

Errors: a subcommand raises (any :class:`rvqstore.errors.RVQError`, ``OSError``, ...) and
:func:`main` prints one line on stderr and exits non-zero; no traceback reaches the user
(``RVQSTORE_DEBUG=1`` shows it).  Exit status: 0 success, 1 failure (invalid file, I/O error, ...),
2 usage error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from . import registry
from .registry import PROG, CLIError, Command

# the built-in commands register themselves on import
from . import file_commands, prompt_commands, demo, store_commands, serve  # noqa: E402,F401  isort: skip
from .file_commands import describe  # noqa: F401 - part of the public CLI module since 0.1

_COMMANDS: list[Command] = registry.COMMANDS


def subcommand(name: str, *, help: str, configure: Callable[[argparse.ArgumentParser], None] | None = None,
               passthrough: bool = False):
    """Register ``fn(args) -> int`` as the subcommand ``name`` (in this module's ``_COMMANDS``, which
    is the built-in registry unless replaced, e.g. by a test)."""
    return registry.register(_COMMANDS, name, help=help, configure=configure, passthrough=passthrough)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage + message by default)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Compressed (TurboQuant-RVQ) LLM KV caches.")
    from .. import __version__ as version

    parser.add_argument("--version", action="version", version=f"{PROG} {version}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for c in _COMMANDS:
        p = sub.add_parser(c.name, help=c.help, description=c.help)
        if c.configure is not None:
            c.configure(p)
        p.set_defaults(_run=c.run, _passthrough=c.passthrough)
    return parser


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "_passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.passthrough = extra
    debug = os.environ.get("RVQSTORE_DEBUG") == "1"
    try:
        code = args._run(args)
        sys.stdout.flush()
        return int(code or 0)
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader of our output went away (e.g. `| head`): not an error of ours
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except Exception as e:  # noqa: BLE001 - the CLI promises one line, never a traceback
        if debug:
            raise
        from ..errors import RVQError

        if isinstance(e, CLIError):
            print(f"{PROG} {args.command}: error: {_one_line(e)}", file=sys.stderr)
            return e.code
        if isinstance(e, RVQError):
            print(f"{PROG} {args.command}: error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        elif isinstance(e, OSError):
            what = e.strerror or _one_line(e)
            where = f": {e.filename}" if e.filename else ""
            print(f"{PROG} {args.command}: error: {what}{where}", file=sys.stderr)
        else:
            print(f"{PROG} {args.command}: internal error: {type(e).__name__}: {_one_line(e)} "
                  f"(set RVQSTORE_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1


__all__ = ["main", "build_parser", "subcommand", "CLIError", "describe", "PROG"]
