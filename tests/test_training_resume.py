"""A training loop stored whole and resumed (issue 40): AdamW, a learning-rate scheduler, a
seeded data order and dropout, so torch's, Python's and numpy's RNGs all matter. The full
state goes to a real server through the client, plain values and all (no skip_non_tensors,
no pickle), comes back with ``to_value()`` and no like, and the resumed loop's next step is
bit for bit the step of a loop that never stopped: on both storage backends, on every transport."""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import pytest
import torch

import tannery

from .server_harness import running_server

#: Two epochs before the checkpoint: the next step shuffles the order again, so Python's RNG decides it too.
SAMPLES, BATCH, STEPS_BEFORE = 48, 8, 12


class Loader:
    """A data order seeded by Python's RNG: shuffled at each epoch, read a batch at a time."""

    def __init__(self) -> None:
        self.epoch, self.cursor, self.order = 0, SAMPLES, list(range(SAMPLES))

    def next(self) -> list[int]:
        if self.cursor >= SAMPLES:
            random.shuffle(self.order)
            self.epoch, self.cursor = self.epoch + 1, 0
        batch = self.order[self.cursor:self.cursor + BATCH]
        self.cursor += BATCH
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "order": list(self.order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor, self.order = state["epoch"], state["cursor"], list(state["order"])


class Run:
    """A model, its AdamW, a cosine schedule and a loader, made from ``seed``."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                         torch.nn.Linear(16, 1))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=3e-2, betas=(0.85, 0.99), weight_decay=0.05)
        self.schedule = torch.optim.lr_scheduler.CosineAnnealingLR(self.optim, T_max=20, eta_min=1e-4)
        self.loader = Loader()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        batch = self.loader.next()
        noise = torch.from_numpy(np.random.normal(0.0, 0.05, size=(len(batch), 6)).astype(np.float32))
        loss = ((self.model(inputs[batch] + noise) - targets[batch]) ** 2).mean()
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        self.schedule.step()
        return loss.detach()

    def state(self, step: int) -> dict[str, Any]:
        """Everything a resumed run needs, as a training loop saves it with torch.save."""
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict(),
                "schedule": self.schedule.state_dict(), "loader": self.loader.state_dict(), "step": step,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}}

    def resume(self, state: dict[str, Any]) -> int:
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])
        self.schedule.load_state_dict(state["schedule"])
        self.loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        return state["step"]

    def snapshot(self) -> dict[str, bytes]:
        """Every parameter's and every optimizer tensor's bits, and the learning rate's."""
        tensors = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        for index, state in self.optim.state_dict()["state"].items():
            tensors.update({f"optim.{index}.{k}": v for k, v in state.items()})
        snap = {name: tannery.torch.serialize(t.detach().clone()) for name, t in tensors.items()}
        snap["lr"] = np.float64(self.schedule.get_last_lr()[0]).tobytes()
        return snap


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(99)
    inputs = torch.randn(SAMPLES, 6, generator=generator)
    return inputs, inputs.sum(1, keepdim=True).sin()


@pytest.mark.parametrize("transport", ["grpc", "local", "tcp"])
def test_a_resumed_loop_takes_the_very_step_of_one_that_never_stopped(tmp_path, backend, transport):
    import tannery.torch  # noqa: F401  (Run.snapshot)

    inputs, targets = data()
    unbroken = Run(seed=1)
    for _ in range(STEPS_BEFORE):
        unbroken.step(inputs, targets)
    checkpoint = copy.deepcopy(unbroken.state(STEPS_BEFORE))  # what the loop stores now
    loss = unbroken.step(inputs, targets)  # the loop that never stopped goes on
    expected = unbroken.snapshot()
    resumed = Run(seed=2)  # another model, other RNG states: everything must come from the store
    resumed.step(inputs, targets)

    # The server runs in this process, and its libraries (a connection pool's jitter, say) may draw
    # from Python's global RNG: so both loops take their step while no server runs, as a job resumed
    # in a process of its own would.
    with running_server(tmp_path, **backend) as server, tannery.Client(server.target, transport=transport) as client:
        info = client.store("run/ckpt", checkpoint)  # no skip_non_tensors: every value kept
        assert client.describe("run/ckpt").values[0].entry == "@values"
        back = client.archive("run/ckpt").to_value()
    # The entries: the model's, 3 per parameter's AdamW state, the torch and numpy RNG states, and @values.
    assert info.entries == len(back["model"]) + 3 * len(back["optim"]["state"]) + 2 + 1
    assert back["optim"]["param_groups"][0]["betas"] == (0.85, 0.99) and back["step"] == STEPS_BEFORE
    assert resumed.resume(back) == STEPS_BEFORE
    assert tannery.torch.serialize(resumed.step(inputs, targets)) == tannery.torch.serialize(loss)
    assert resumed.snapshot() == expected


@pytest.mark.parametrize("left_out", ["torch", "python", "numpy", "schedule", "loader"])
def test_each_part_of_the_state_decides_the_next_step(left_out):
    """What makes the test above mean something: with any one part of the state not restored,
    the resumed step differs."""
    import tannery.torch  # noqa: F401  (Run.snapshot)

    inputs, targets = data()
    unbroken = Run(seed=1)
    for _ in range(STEPS_BEFORE):
        unbroken.step(inputs, targets)
    archive = tannery.Archive.of_value(copy.deepcopy(unbroken.state(STEPS_BEFORE)))  # of_value copies nothing
    unbroken.step(inputs, targets)
    resumed = Run(seed=2)
    back = archive.to_value()
    now = resumed.state(0)
    if left_out in ("torch", "python", "numpy"):
        back["rng"][left_out] = now["rng"][left_out]
    else:
        back[left_out] = now[left_out]
    resumed.resume(back)
    resumed.step(inputs, targets)
    assert resumed.snapshot() != unbroken.snapshot()
