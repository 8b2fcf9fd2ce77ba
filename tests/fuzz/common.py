"""What the atheris targets share: importing tannery's codec instrumented, and the reference splitter.

Run a target as a script (``python tests/fuzz/fuzz_codec.py [libFuzzer flags] DIR...``);
``make fuzz`` runs each for a bounded time on its kept corpus, ``tests/fuzz/corpus/<target>/``.
Nothing here is collected by pytest (no ``test_`` names; ``tests/conftest.py`` ignores this folder).
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

ROOT = Path(__file__).resolve().parents[2]
# The code under test: this checkout's, instrumented for coverage (ahead of an installed copy).
for source in (ROOT / "client",):
    if str(source) not in sys.path:
        sys.path.insert(0, str(source))

with atheris.instrument_imports(include=["tannery_protocol", "tannery"]):
    from tannery_protocol import codec
    from tannery_protocol import framing  # noqa: E402

#: Dtype names in a fixed order, for inputs that pick one by index.
DTYPE_NAMES = sorted(codec.DTYPES)


def reference_split(stream: bytes) -> list[bytes]:
    """The payloads of ``stream`` read one after the other with ``read_info`` on the whole rest:
    what a Deframer must produce whatever the chunking. FormatError when it is not whole payloads."""
    payloads, pos = [], 0
    while pos < len(stream):
        info = codec.read_info(stream[pos:])
        if info is None or pos + info.size > len(stream):
            raise codec.FormatError("truncated")
        payloads.append(stream[pos : pos + info.size])
        pos += info.size
    return payloads


def main(test_one_input) -> None:
    """Run ``test_one_input`` under libFuzzer with this process's arguments."""
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
