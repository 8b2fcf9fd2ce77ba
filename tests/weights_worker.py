"""A worker process of the weight-sync tests: follows weights ``NAME`` on ``TARGET`` with a
model made as :func:`model` makes it, and prints a JSON line per version applied (its number,
the version before it, the SHA-256 of every tensor, and whether every parameter is still
where it was), until version ``--until`` or SIGTERM.

    python -m tests.weights_worker TARGET NAME --until 4 [--dtype bfloat16] [--rows 4:8]
    python -m tests.weights_worker TARGET NAME --until 4 --rl [--load OLD.pt]

``--rl`` follows the bf16 state dict of :func:`rl_shapes` instead of the model; ``--load``
starts from a state dict saved on disk (a worker restarted with an old version).
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


#: The shapes of the RL-like state dict (bf16 weights of an fp32 master): 2 MiB in bf16.
RL_SHAPES = {f"blocks.{i}.weight": (512, 512) for i in range(4)}


def rl_target() -> dict[str, torch.Tensor]:
    """A worker's RL-like state dict, all zeros (other weights than the trainer's)."""
    return {key: torch.zeros(shape, dtype=torch.bfloat16) for key, shape in RL_SHAPES.items()}


class RLTrainer:
    """Versions as RL post-training makes them: an fp32 master with small weights, one AdamW
    step at lr 1e-6 on random-normal gradients per version, cast to bf16 (2-4% of elements change)."""

    def __init__(self, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.master = {key: 0.02 * torch.randn(shape, generator=generator) for key, shape in RL_SHAPES.items()}
        self.optimizer = torch.optim.AdamW(list(self.master.values()), lr=1e-6)
        self.generator = generator

    def state(self) -> dict[str, torch.Tensor]:
        return {key: t.to(torch.bfloat16) for key, t in self.master.items()}

    def step(self) -> dict[str, torch.Tensor]:
        for tensor in self.master.values():
            tensor.grad = torch.randn(tensor.shape, generator=self.generator)
        self.optimizer.step()
        return self.state()


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
    parser.add_argument("--rl", action="store_true")
    parser.add_argument("--load")
    args = parser.parse_args()
    if args.rl:
        worker = rl_target()
    else:
        worker = model(seed=1).to(getattr(torch, args.dtype))  # other weights than the trainer's
    state_of = (lambda: worker) if isinstance(worker, dict) else worker.state_dict
    if args.load:  # the version it held before it was restarted
        loaded = torch.load(args.load)
        with torch.no_grad():
            for key, tensor in state_of().items():
                tensor.copy_(loaded[key])
    where = {key: t.data_ptr() for key, t in state_of().items()}
    with tannery.Client(args.target) as client, tannery.weights.Follower(client, args.name, worker) as follower:
        print(json.dumps({"ready": True}), flush=True)  # subscribed: every version pushed from now on streams here
        for applied in follower:
            state = state_of()
            print(json.dumps({"version": applied.version, "previous": applied.previous, "via": applied.via,
                              "delta": applied.delta,
                              "digests": digests(state),
                              "in_place": all(t.data_ptr() == where[key] for key, t in state.items())}),
                  flush=True)
            if applied.version >= args.until:
                break


if __name__ == "__main__":
    sys.exit(main())
