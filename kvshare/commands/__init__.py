"""One module per ``kvshare`` subcommand: add_arguments(parser) and run(args) -> exit code."""

from __future__ import annotations

import argparse
import copy
import signal
from contextlib import contextmanager


def tcp_port(text: str) -> int:
    """A TCP port for argparse (``--port 70000`` is refused with one line and exit 2, not a traceback)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (1-65535)")
    return port


def non_negative_int(text: str) -> int:
    """A count of zero or more for argparse (a negative one refused with one line and exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


@contextmanager
def sigterm_as_interrupt():
    """Within it, SIGTERM (e.g. from `timeout`) stops like Ctrl-C: what was measured is kept and reported, and the
    processes a benchmark started are stopped in order."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame) -> None:
    """What Ctrl-C would do now: SIGINT's Python handler (asyncio.run's cancels its main task), else
    KeyboardInterrupt. Not a SIGINT sent to ourselves: a job started in the background by a script ignores SIGINT,
    and SIGTERM would then do nothing at all."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, unless its help already says it or there is none to show
    (None, off flags, empty lists)."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _has_default(action):  # an option without help still shows its default
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or not _has_default(action):
            return text
        return super()._get_help_string(action)


def _has_default(action: argparse.Action) -> bool:
    return action.default not in (None, False, "", [], (), argparse.SUPPRESS) and action.nargs != 0


class RawDescriptionDefaultsHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``DefaultsHelpFormatter`` that keeps the description's own line breaks (tables, examples)."""
