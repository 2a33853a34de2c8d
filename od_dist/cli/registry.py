"""The registry of `od-dist` commands: each registers its name, help and flags with `@command`, and
the entry point (__init__.py) parses and runs it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from absl import flags


class UsageError(Exception):
    """Bad flags or input found by a command; printed as is, exit 2."""


@dataclass(frozen=True)
class Command:
    name: str
    summary: str
    usage: str  # description and example, shown by --help
    define: Callable[[flags.FlagValues], None]
    run: Callable[[flags.FlagValues], int]
    # The flags that take several files (multi-string flags): each also takes the paths that follow
    # it, as a shell writes an unquoted glob (`--records data/*.tfrecord`).
    lists: tuple[str, ...] = ()
    rest: str | None = None  # the one of `lists` that also takes the paths left after the flags
    # Flags of the shared definitions that this command refuses with a reason (--role/--index for
    # the commands that cover every task): left out of its --help.
    refused: tuple[str, ...] = ()


COMMANDS: dict[str, Command] = {}


def command(
    name: str,
    summary: str,
    usage: str,
    define: Callable[[flags.FlagValues], None],
    lists: tuple[str, ...] = (),
    rest: str | None = None,
    refused: tuple[str, ...] = (),
):
    def register(fn):
        COMMANDS[name] = Command(name, summary, usage.strip("\n"), define, fn, lists, rest, refused)
        return fn

    return register
