"""The trainer of the relay benchmark and tests, run in the server's namespace (where the server's
address and metrics are reached). It reads commands on stdin and answers each with a JSON line:

- ``push N``: pushes a new version of COUNT float32 tensors (SIZE bytes in all); answers
  ``{"kind": "pushed", "version", "started", "done", "delta", "sha"}`` (wall times, and the
  SHA-256 of the version as the workers compute theirs);
- ``push N delta``: a version that differs from the one before in 1% of each tensor's elements
  (streamed as a delta);
- ``out``: ``{"kind": "out", "bytes"}``, the payload bytes the server has handed its channel
  subscribers so far (its metrics): the server's egress on the channel.

    python -m tests.benchmarks.relay_trainer TARGET NAME SIZE COUNT METRICS_URL   (TANNERY_TRANSPORT)
"""

from __future__ import annotations

import json
import sys
import time

import torch

import tannery

from .weight_sync_rl import channel_bytes
from .weight_sync_worker import state_dict, state_digest


def main() -> None:
    target, name, size, count, metrics = sys.argv[1:6]
    state = state_dict(int(size), int(count), dtype="float32")
    with tannery.Client(target) as client:
        publisher = tannery.weights.Publisher(client, name, keep=2)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            words = line.split()
            if words == ["out"]:
                print(json.dumps({"kind": "out", "bytes": channel_bytes(metrics)["out"]}), flush=True)
                continue
            if not words or words[0] != "push":
                break
            version = int(words[1])
            generator = torch.Generator().manual_seed(version)
            with torch.no_grad():
                for tensor in state.values():
                    if words[2:] == ["delta"]:
                        flat = tensor.view(-1)
                        flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=generator)] += 1.0
                    else:
                        tensor.uniform_(generator=generator)
            started = time.time()
            pushed = publisher.push(state, version)
            print(json.dumps({"kind": "pushed", "version": version, "started": started, "done": time.time(),
                              "delta": pushed.delta, "sha": state_digest(state)}), flush=True)

if __name__ == "__main__":
    main()
