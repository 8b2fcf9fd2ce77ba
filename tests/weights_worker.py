"""A worker process of the weight-sync tests: follows weights ``NAME`` on ``TARGET`` with a
model made as :func:`model` makes it, and prints a JSON line per version applied (its number,
the version before it, the SHA-256 of every tensor, and whether every parameter is still
where it was), until version ``--until`` or SIGTERM.

    python -m tests.weights_worker TARGET NAME --until 4 [--dtype bfloat16] [--rows 4:8]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

import tannery


def model(seed: int = 0) -> torch.nn.Module:
    """The small real model the tests push: two linear layers and a layer norm (its buffers too)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.LayerNorm(48), torch.nn.Linear(48, 16))


def digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """The SHA-256 of each tensor's bytes (contiguous), by key."""
    return {key: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            if t.numel() else "" for key, t in state.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("name")
    parser.add_argument("--until", type=int, required=True)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    worker = model(seed=1).to(getattr(torch, args.dtype))  # other weights than the trainer's
    where = {key: t.data_ptr() for key, t in worker.state_dict().items()}
    with tannery.Client(args.target) as client, tannery.weights.Follower(client, args.name, worker) as follower:
        print(json.dumps({"ready": True}), flush=True)  # subscribed: every version pushed from now on streams here
        for applied in follower:
            state = worker.state_dict()
            print(json.dumps({"version": applied.version, "previous": applied.previous, "via": applied.via,
                              "digests": digests(state),
                              "in_place": all(t.data_ptr() == where[key] for key, t in state.items())}),
                  flush=True)
            if applied.version >= args.until:
                break


if __name__ == "__main__":
    sys.exit(main())
