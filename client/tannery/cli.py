"""The ``tannery`` command. For now one subcommand, ``serve``, which runs the server.

The server package is imported only when ``serve`` is asked for, so the rest of the
command (to come) does not load it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "serve":
        from tannery_server.cli import main as serve_main

        return serve_main(args)
    parser = argparse.ArgumentParser(prog="tannery", description="tannery: a gRPC tensor service")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("serve", help="run the server (tannery serve --help for its flags)", add_help=False)
    parser.parse_args(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
