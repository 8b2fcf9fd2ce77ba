"""What the command prints: human sizes and times, tables, JSON and transfer progress bars.

Tables, status lines and JSON go to stdout; progress bars and errors to stderr, so a
script can read stdout while a person watches the bar. Nothing here imports torch, and
rich only for a progress bar or a table wider than the terminal.
"""

from __future__ import annotations

import datetime as dt
import re
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_size(nbytes: float) -> str:
    """A size in binary units with one decimal: ``512 B``, ``1.5 MiB``."""
    value = float(nbytes)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def as_datetime(value: Any) -> dt.datetime | None:
    """A record's creation time as an aware UTC datetime (from a datetime, a protobuf
    Timestamp or seconds since the epoch); None when there is none."""
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    if hasattr(value, "ToDatetime"):
        if not (value.seconds or value.nanos):
            return None
        return value.ToDatetime(tzinfo=dt.timezone.utc)
    if isinstance(value, (int, float)):
        return dt.datetime.fromtimestamp(value, dt.timezone.utc)
    return None


def iso_time(value: Any) -> str | None:
    """A creation time for JSON: ISO 8601 in UTC, ``2025-01-31T12:00:00Z``; None when unknown."""
    when = as_datetime(value)
    if when is None:
        return None
    return when.astimezone(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def local_time(value: Any) -> str:
    """A creation time for people: local time to the second, ``-`` when unknown."""
    when = as_datetime(value)
    return "-" if when is None else when.astimezone().strftime("%Y-%m-%d %H:%M:%S")


#: A list of numbers that json.dumps spread over lines (a raw newline never occurs inside a JSON string).
_NUMBER_LIST = re.compile(r"\[\n\s*([-+0-9.eE,\s]*?)\n\s*\]")


def compact_json(value: Any) -> str:
    """``value`` as JSON indented by two, with lists of numbers such as shapes on one line."""
    import json  # here: only --json needs it

    text = json.dumps(value, indent=2, allow_nan=False)
    return _NUMBER_LIST.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


class Output:
    """Where a command writes: stdout for results, stderr for progress and errors.

    ``quiet`` silences what goes to stderr while a command works, progress bars and notes
    (never results or errors). Bars are shown only when stderr is a terminal.
    """

    def __init__(self, quiet: bool = False, stdout: Any = None, stderr: Any = None) -> None:
        self.quiet = quiet
        self.stdout = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr

    def line(self, text: str = "", flush: bool = False) -> None:
        """A result line on stdout (printed even with --quiet)."""
        print(text, file=self.stdout, flush=flush)

    def result(self, text: str) -> None:
        """A line saying what the command did (``pushed ...``, ``deleted ...``), on stdout:
        the command's result, printed with --quiet too."""
        print(text, file=self.stdout)

    def note(self, text: str) -> None:
        """A line about progress (not a result) on stderr; silent with --quiet."""
        if not self.quiet:
            print(text, file=self.stderr, flush=True)

    def warning(self, text: str) -> None:
        """A line about something the user should know of (data left out), on stderr, printed
        with --quiet too: it is not progress."""
        print(f"warning: {text}", file=self.stderr, flush=True)

    def json(self, value: Any) -> None:
        """``value`` as indented JSON on stdout, lists of numbers (shapes) on one line."""
        print(compact_json(value), file=self.stdout)

    def table(self, columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]], footer: str | None = None) -> None:
        """A table on stdout: ``columns`` are (header, justify) pairs, ``rows`` strings.

        Columns are two spaces apart and rows never wrap, so ``grep`` and ``awk`` see one row
        per line; cells are printed as given (no markup). On a terminal the header is bold, and
        a table wider than the terminal is fitted to it by rich, imported only then (rich costs
        more to import than the rest of ``tannery ls``).
        """
        lines = plain_table(columns, rows)
        terminal = _isatty(self.stdout)
        if terminal and max(map(cell_width, lines), default=0) > _terminal_width():
            self._rich_table(columns, rows, footer)
            return
        for index, line in enumerate(lines):
            print(f"\x1b[1m{line}\x1b[0m" if index == 0 and terminal and _bold_ok() else line, file=self.stdout)
        if footer:
            print(footer, file=self.stdout)

    def _rich_table(self, columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]], footer: str | None) -> None:
        """The table fitted to the terminal's width by rich (long cells folded)."""
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, header_style="bold", pad_edge=False, show_edge=False)
        for header, justify in columns:
            table.add_column(header, justify=justify, no_wrap=True, overflow="fold")
        for row in rows:
            table.add_row(*(Text(cell) for cell in row))  # Text: a name such as "[b]" is no markup
        console = self._console(self.stdout)
        console.print(table)
        if footer:
            console.print(footer, highlight=False, markup=False)

    @staticmethod
    def _console(stream: Any) -> Any:
        from rich.console import Console

        terminal = _isatty(stream)
        # Off a terminal: no colours, and as wide as the content needs.
        return Console(file=stream, width=None if terminal else 100_000, no_color=not terminal,
                       highlight=False, soft_wrap=not terminal)

    @contextmanager
    def transfer(self, description: str, total: int | None) -> Iterator[Callable[[int], None]]:
        """A progress bar of bytes on stderr (bytes done, rate, time left); yields the
        callback to report each transferred amount. A no-op off a terminal or with --quiet."""
        if self.quiet or not _isatty(self.stderr):
            yield _ignore
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        console = self._console(self.stderr)
        columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                   _rate_column(), TimeRemainingColumn()]
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task(description, total=total)

            def advance(nbytes: int) -> None:
                progress.update(task, advance=nbytes)

            yield advance
            if total is not None:
                progress.update(task, completed=total)


def plain_table(columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a table: a header, then a line per row, each column as wide as its widest
    cell and justified as its ``(header, justify)`` says ("left" or "right"), two spaces apart,
    no trailing spaces."""
    table = [[header for header, _ in columns], *([str(cell) for cell in row] for row in rows)]
    widths = [max(cell_width(line[i]) for line in table) for i in range(len(columns))]
    lines = []
    for line in table:
        cells = []
        for (_, justify), width, cell in zip(columns, widths, line):
            pad = " " * (width - cell_width(cell))
            cells.append(pad + cell if justify == "right" else cell + pad)
        lines.append("  ".join(cells).rstrip())
    return lines


def cell_width(text: str) -> int:
    """Columns ``text`` takes on a terminal: two for wide (East Asian) characters, none for
    combining marks, one for the others."""
    if text.isascii():
        return len(text)
    import unicodedata

    width = 0
    for char in text:
        if unicodedata.combining(char):
            continue
        width += 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
    return width


def shorten(text: str, most: int) -> str:
    """``text`` cut to at most ``most`` terminal columns, ending with an ellipsis when cut (wide
    characters count two); a table of long names stays readable, --json keeps them whole."""
    if cell_width(text) <= most:
        return text
    kept, width = [], 0
    for char in text:
        step = cell_width(char)
        if width + step > most - 1:
            break
        kept.append(char)
        width += step
    return "".join(kept) + "…"


def _terminal_width() -> int:
    import shutil

    return shutil.get_terminal_size().columns


def _bold_ok() -> bool:
    """Whether the terminal takes escape codes (not TERM=dumb)."""
    import os

    return os.environ.get("TERM", "") != "dumb"


def _ignore(nbytes: int) -> None:
    pass


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _rate_column() -> Any:
    """A rich column showing the transfer rate in binary units, ``12.3 MiB/s``."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class BinaryRateColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{human_size(speed)}/s", style="progress.data.speed")

    return BinaryRateColumn()
