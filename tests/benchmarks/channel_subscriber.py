"""A subscriber in a process of its own, for the channels case's same-host table and the
channel-fanout case.

``python -m tests.benchmarks.channel_subscriber TARGET TRANSPORT COUNT [CHANNEL]``: subscribes
(to CHANNEL, else ``same-host-TRANSPORT``), prints
``ready``, receives COUNT tensors (reading one element of each, so a mapped payload is
really there), then prints ``done <time.monotonic()>`` at the last one, for each round on
standard input (one line per round).
"""

from __future__ import annotations

import sys
import time

import tannery


def main() -> None:
    target, transport, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    channel = sys.argv[4] if len(sys.argv) > 4 else f"same-host-{transport}"
    with tannery.Client(target, transport=transport) as client, client.subscribe(channel) as subscription:
        print("ready", flush=True)
        for _ in sys.stdin:
            for _, tensor in zip(range(count), subscription):
                float(tensor.view(-1)[-1])
            print(f"done {time.monotonic()}", flush=True)


if __name__ == "__main__":
    main()
