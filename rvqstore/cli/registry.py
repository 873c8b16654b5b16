"""The subcommand registry and the CLI's one error type (imported by every command module).

A command module registers ``fn(args) -> int`` with :func:`subcommand`; its arguments are declared by
a small ``configure(parser)`` function::

    def _generate_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--prompt-cache", required=True)

    @subcommand("generate", help="continue a cached prompt", configure=_generate_args)
    def cmd_generate(args: argparse.Namespace) -> int:
        ...
        return 0
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

PROG = "rvqstore"


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None] | None
    run: Callable[[argparse.Namespace], int]
    passthrough: bool = False  # unknown options go to ``args.passthrough`` (a wrapped program's own)


COMMANDS: list[Command] = []


def register(commands: list[Command], name: str, *, help: str,
             configure: Callable[[argparse.ArgumentParser], None] | None = None, passthrough: bool = False):
    """Decorator: add ``fn(args) -> int`` to ``commands`` as the subcommand ``name``."""

    def deco(fn: Callable[[argparse.Namespace], int]):
        if any(c.name == name for c in commands):
            raise ValueError(f"subcommand {name!r} registered twice")
        commands.append(Command(name, help, configure, fn, passthrough))
        return fn

    return deco


def subcommand(name: str, *, help: str, configure: Callable[[argparse.ArgumentParser], None] | None = None,
               passthrough: bool = False):
    """Register ``fn(args) -> int`` as the built-in subcommand ``name``."""
    return register(COMMANDS, name, help=help, configure=configure, passthrough=passthrough)


class CLIError(Exception):
    """A failure to report as one line with exit status ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code
