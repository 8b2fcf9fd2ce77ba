"""A subscriber in a process of its own, for the channels case's same-host table.

``python -m tests.benchmarks.channel_subscriber TARGET TRANSPORT COUNT``: subscribes, prints
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
    with tannery.Client(target, transport=transport) as client, client.subscribe(f"same-host-{transport}") as subscription:
        print("ready", flush=True)
        for _ in sys.stdin:
            for _, tensor in zip(range(count), subscription):
                float(tensor.view(-1)[-1])
            print(f"done {time.monotonic()}", flush=True)


if __name__ == "__main__":
    main()
