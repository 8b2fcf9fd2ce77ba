"""How each series looks in the plots: a colour, a marker and a line style, fixed by its name.

Every series the suite draws is listed in ``SERIES``, grouped by the plot it appears in, and
takes the next look of a fixed sequence: so a series looks the same in every plot and every
run, and the series of one plot all have different colours (tests/test_bench_report.py
checks both). A name missing from the list still gets a fixed look, from a hash of the name,
moved on to the next colour nobody in its plot has: add new series to ``SERIES``.

No matplotlib here: the names, colours and markers are plain data the tests can check.
"""

from __future__ import annotations

import zlib
from typing import Iterable, NamedTuple

#: Colours told apart at a glance: matplotlib's ten "tab" colours, then black and gold.
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#000000", "#e6ab02")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", ":")

#: The series of each plot, in the order they take their looks (names as the cases give them).
SERIES: dict[str, tuple[str, ...]] = {
    "transport": (
        "raw grpcio ceiling", "ceiling + durable write / file read", "tannery Store/Fetch (pre-built messages)",
        "tannery.Client grpc", "tannery.Client local", "tannery.Client tcp", "pytannic over TCP",
        "torch.save bytes over gRPC", "Arrow Flight DoPut/DoGet", "pytannic over TCP, Client.receive as shipped"),
    "codec": (
        "pytannic serialize + deserialize (baseline)", "serialize + deserialize, bytes",
        "service path: parts, gather, in place", "service path through the Reframer, 1 MiB chunks",
        "torch.save + torch.load, bytes", "safetensors save + load, bytes"),
    "fetch": (
        "tannery.Client.fetch", "tannery Fetch, raw stub", "raw grpcio call (the same bytes)",
        "safetensors safe_open + get_tensor (local file)", "safetensors safe_open + get_tensor + clone (local file)"),
    "channels": ("tannery", "bare relay"),
    "scale": ("Store", "Sink", "Fetch", "Source"),
}


class Look(NamedTuple):
    colour: str
    marker: str
    linestyle: str

    def line(self) -> dict[str, str]:
        """Keyword arguments for matplotlib's ``plot``."""
        return {"color": self.colour, "marker": self.marker, "linestyle": self.linestyle}


def _registered() -> dict[str, int]:
    slots: dict[str, int] = {}
    for names in SERIES.values():
        for name in names:
            slots.setdefault(name, len(slots))
    return slots


#: Series name -> its place in the sequence of looks.
SLOTS = _registered()


def look_of(slot: int) -> Look:
    """The ``slot``-th look: the colour and the marker both step with the slot (12 colours and
    8 markers come round together every 24 slots), the line style every 24: 72 different looks."""
    return Look(COLOURS[slot % len(COLOURS)], MARKERS[slot % len(MARKERS)],
                LINESTYLES[slot // 24 % len(LINESTYLES)])


def looks(names: Iterable[str]) -> dict[str, Look]:
    """The looks of one plot's series, by name: registered names always their own; others
    from a hash of the name, moved on to a colour no other series of this plot has."""
    names = list(dict.fromkeys(names))
    chosen = {name: look_of(SLOTS[name]) for name in names if name in SLOTS}
    for name in names:
        if name in chosen:
            continue
        slot = len(SLOTS) + zlib.crc32(name.encode()) % 72
        taken = {look.colour for look in chosen.values()}
        for _ in range(len(COLOURS)):
            if look_of(slot).colour not in taken:
                break
            slot += 1
        chosen[name] = look_of(slot)
    return {name: chosen[name] for name in names}
