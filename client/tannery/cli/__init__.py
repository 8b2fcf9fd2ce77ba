"""The ``tannery`` command: ``serve`` runs the server, the other subcommands are a client.

Subcommands live in small modules (``archives``, ``aliases``, ``channels``); ``output`` formats what
they print, ``tensorfiles`` reads and writes files, ``connection`` makes the client.
Building the parser imports neither torch nor the server: ``serve``, ``scrub`` and
``migrate`` hand over at once to the command the server's package registers (the entry
point group ``tannery.commands``; this package never imports the server's), and the client
subcommands import torch-facing modules when they run.

Exit status: 0 on success, 1 on a failure (on stderr, one line saying what failed: the
server's message, the file, or the target that cannot be reached; then, when there is
something to do about it, a ``hint:`` line saying what), 2 on a usage error, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from tannery import __version__
from .connection import add_global_options, target_of, target_source, tls_options
from .errors import Where, error_message, one_line, remedy
from .output import Output

#: Set to 1 to get a traceback for an unexpected error (a bug) instead of one line.
DEBUG_ENV = "TANNERY_DEBUG"

DESCRIPTION = """\
tannery: store, fetch and stream tensors through a tannery server: checkpoints as
archives of named tensors, fetched whole or tensor by tensor, and channels that stream
tensors between processes. The server is --target (or TANNERY_TARGET), localhost:50051
by default; each subcommand's --help shows its options and examples."""

EPILOG = """\
examples:
  tannery serve --data-dir ./tannery-data
  tannery push model.safetensors --as mnist
  tannery ls
  tannery show mnist --json
  tannery get mnist output_layer.bias
  tannery pull mnist -o copy.safetensors
  tannery --target gpu-box:50051 ls

exit status: 0 on success, 1 on failure (the reason on one line on stderr, then a "hint:"
line when there is something to do), 2 on a usage error, 130 when interrupted (Ctrl-C)."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' lines as written; wraps descriptions to the terminal."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every client subcommand (``serve`` is listed; its own parser is the server's)."""
    from .commands import add_commands
    from .version_commands import add_version_commands

    parser = argparse.ArgumentParser(prog="tannery", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"tannery {__version__}")
    add_global_options(parser, on_subcommand=False)
    common = argparse.ArgumentParser(add_help=False)
    add_global_options(common, on_subcommand=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("serve", help="run the server (tannery serve --help for its flags)", add_help=False)
    commands.add_parser("scrub", help="check every stored blob against its SHA-256, server stopped (tannery scrub --help)",
                        add_help=False)
    commands.add_parser("migrate", help="copy a data directory into a PostgreSQL catalog and a bucket "
                        "(tannery migrate --help)", add_help=False)
    add_commands(commands, common, _Formatter)
    add_version_commands(commands, common, _Formatter)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (it never raises, but for SystemExit
    from --help and usage errors, as argparse does)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] in SERVER_COMMANDS:
            return _server_command(args[0])(args)
        parsed = build_parser().parse_args(_dash_values(args))
        # gRPC's C core logs failed TLS handshakes and the like on stderr; the error line says it.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
        if not parsed.quiet:
            _note_retries(target_of(parsed))
        return _run(parsed, Output(quiet=bool(parsed.quiet)))
    except KeyboardInterrupt:
        print("tannery: interrupted", file=sys.stderr)
        return 130


#: Subcommands the server's package provides (entry point group ``tannery.commands``).
SERVER_COMMANDS = ("serve", "scrub", "migrate")


def _server_command(name: str) -> Callable[[list[str]], int]:
    """The server's ``main`` for subcommand ``name``, through its entry point; SystemExit
    saying what to install when the server is not installed."""
    from importlib.metadata import entry_points

    found = entry_points(group="tannery.commands", name=name)
    if not found:
        raise SystemExit(f"tannery {name}: the server is not installed here: pip install . in a clone of tannery, "
                         "or the wheel make dist builds (the server is in the package's core; the client extra "
                         "adds torch)")
    return next(iter(found)).load()


def _note_retries(target: str) -> None:
    """Each retry of a call (tannery.rpc.retries logs it at INFO) as a line on stderr, so that a
    command waiting for a restarting server says why it waits."""
    import logging

    class RetryNote(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            error = getattr(record, "error", None)
            if error is None:
                return f"tannery: {record.getMessage()}"
            return (f"tannery: {record.call}: {error_message(error, target)}; retry {record.retry} of "
                    f"{record.retries} in {record.pause:.1f} s")

    logger = logging.getLogger("tannery.client")
    for old in [h for h in logger.handlers if getattr(h, "tannery_cli", False)]:
        logger.removeHandler(old)  # main() run again in one process (tests)
    handler = logging.StreamHandler()  # stderr as it is when a record comes (tests swap it)
    handler.setFormatter(RetryNote())
    handler.tannery_cli = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


#: Options whose value may start with a dash (an archive named ``-dash``): argparse would take it
#: for an option, so ``--as -dash`` is passed on as ``--as=-dash``.
_NAME_OPTIONS = ("--as",)


def _dash_values(argv: list[str]) -> list[str]:
    """``argv`` with each ``--as VALUE`` whose value starts with a dash joined as ``--as=VALUE``."""
    out: list[str] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        if token in _NAME_OPTIONS and index + 1 < len(argv) and argv[index + 1].startswith("-") \
                and argv[index + 1] not in ("-h", "--help"):
            out.append(f"{token}={argv[index + 1]}")
            index += 2
            continue
        out.append(token)
        index += 1
    return out


def _run(args: argparse.Namespace, out: Output) -> int:
    """Run the parsed subcommand; a failure becomes one line on stderr and status 1."""
    try:
        status = int(args.run(args, out) or 0)
        sys.stdout.flush()  # here, so that a closed pipe is caught below rather than at exit
        return status
    except KeyboardInterrupt:
        raise
    except BrokenPipeError:
        # stdout was closed early (tannery ls | head): not an error worth a message.
        _silence_stdout()
        return 1
    except Exception as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        _report(exc, args)
        return 1


def _report(exc: Exception, args: argparse.Namespace) -> None:
    """Print a failure: what happened on one line, then what to do (``hint: ...``) when there
    is something to do."""
    where = Where(target_of(args), target_source(args), _using_tls(args), args.command)
    message, advice = error_message(exc, where.target) + _close_archives(exc, args), remedy(exc, where)
    if not _expected(exc):
        message = f"an unexpected {type(exc).__name__}: {message}"
        advice = f"this is a bug in tannery; run again with {DEBUG_ENV}=1 for the traceback to report"
    print(f"tannery {args.command}: error: {message}", file=sys.stderr)
    if advice:
        print(f"hint: {one_line(advice)}", file=sys.stderr)


def _close_archives(exc: Exception, args: argparse.Namespace) -> str:
    """For an archive that is not found, ``"; did you mean 'resnet50'?"`` with the server's close
    names (one List, as a mistyped entry name gets the archive's); "" otherwise, or when the
    server cannot be asked."""
    import ast
    import re

    from tannery_protocol.errors import NotFound

    found = re.match(r"archive ('.*'|\".*\") not found", str(exc)) if isinstance(exc, NotFound) else None
    if found is None:
        return ""
    try:
        missing = ast.literal_eval(found.group(1))
        from tannery_protocol.names import did_you_mean
        from .connection import connect

        with connect(args) as client:
            return did_you_mean(missing, [info.name for info in client.list()])
    except Exception:  # a suggestion is a courtesy: the error itself is what matters
        return ""


def _using_tls(args: argparse.Namespace) -> bool:
    try:
        return tls_options(args) is not None
    except Exception:
        return False


def _expected(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure the user can act on (not a bug in tannery)."""
    from tannery_protocol.errors import ServiceError
    from .errors import CommandError, missing_extra

    return isinstance(exc, (CommandError, ServiceError, OSError, ValueError, LookupError)) or missing_extra(exc)


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
