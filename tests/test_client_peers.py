"""The client with other programs: checkpoints they wrote, stored and fetched back by name
and compared bit for bit with their own reading, and a channel between two processes."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import tannery
from tannery.torch import serialize

from .conftest import ROOT

MiB = 1 << 20


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and serialize(a) == serialize(b)


# -- a .safetensors file written by the safetensors library -----------------------------------


def test_a_safetensors_checkpoint_is_stored_and_every_tensor_fetched_by_name(server, tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed.weight": torch.randn(1000, 64, generator=generator),  # over a message: chunked
        "model.norm.weight": torch.randn(64, generator=generator).to(torch.bfloat16),
        "model.head.bias": torch.randn(10, generator=generator).to(torch.float16),
        "model.mask": torch.rand(7, 3, generator=generator) > 0.5,
        "step": torch.tensor(1234, dtype=torch.int64),
        "ids": torch.randint(0, 255, (33,), generator=generator, dtype=torch.uint8),
        "model.fp8": torch.randn(16, generator=generator).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 5),
    }
    path = tmp_path / "ckpt.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    theirs = safetensors.torch.load_file(str(path))  # the library's own reading
    with tannery.Client(server.target) as client:
        info = client.store("ckpt", tannery.load_safetensors(path))
        assert info.entries == len(theirs)
        remote = client.archive("ckpt")
        assert remote.names() == sorted(theirs)
        for name, tensor in theirs.items():
            assert same_bits(remote.tensor(name, tensor.shape, tensor.dtype), tensor), name
        # ... and back to a file the library reads as it wrote it.
        tannery.save_safetensors(tmp_path / "back.safetensors", client.fetch("ckpt"))
        again = safetensors.torch.load_file(str(tmp_path / "back.safetensors"))
        assert all(same_bits(again[name], theirs[name]) for name in theirs)


# -- .tannic pairs written by pytannic (../shared/fixtures/tannic-nn) --------------------------

#: The shapes the pairs do not store, from the C++ model definitions (the fixtures' README).
SHAPES = {
    "MLP": {"input_layer.weight": (512, 784), "input_layer.bias": (512,), "output_layer.weight": (10, 512),
            "output_layer.bias": (10,)},
    "CNN": {"convolutional_layer.weight": (32, 1, 3, 3), "convolutional_layer.bias": (32,),
            "output_layer.weight": (10, 25088), "output_layer.bias": (10,)},
    "dev-embd": {"weight": (8192,)},
}


def pytannic_read(stem: Path) -> dict[str, torch.Tensor]:
    """A pair read with pytannic's own structures (Header, parameter Metadata, dtypeof)."""
    from pytannic.header import Header
    from pytannic.torch.parameters import Metadata
    from pytannic.torch.types import dtypeof

    header_size = struct.calcsize(Header.FORMAT)
    entry_size = struct.calcsize(Metadata.FORMAT)
    meta = Path(f"{stem}.metadata.tannic").read_bytes()
    data = Path(f"{stem}.tannic").read_bytes()
    assert Header.unpack(meta[:header_size]).nbytes == len(meta) - header_size
    tensors = {}
    pos = header_size
    while pos < len(meta):
        # Metadata.unpack of pytannic 0.1.5 cannot build its own dataclass (it leaves out name):
        # its struct format, then the name that follows.
        dcode, offset, nbytes, namelength = struct.unpack(Metadata.FORMAT, meta[pos : pos + entry_size])
        pos += entry_size
        entry = Metadata(dcode, offset, nbytes, namelength, meta[pos : pos + namelength].decode())
        name = entry.name
        pos += namelength
        start = header_size + entry.offset
        buffer = bytearray(data[start : start + entry.nbytes])
        tensors[name] = torch.frombuffer(buffer, dtype=dtypeof(entry.dcode))
    return tensors


@pytest.mark.parametrize("stem", list(SHAPES))
def test_tannic_pairs_written_by_pytannic_are_stored_and_fetched_by_name(server, tannic_nn, stem):
    theirs = pytannic_read(tannic_nn / stem)
    assert set(theirs) == set(SHAPES[stem])
    like = {name: torch.empty(shape, dtype=theirs[name].dtype) for name, shape in SHAPES[stem].items()}
    with tannery.Client(server.target) as client:
        client.store(stem, tannery.load_tannic(tannic_nn / stem, like=like), prefix="model")
        remote = client.archive(stem)
        assert remote.names() == sorted(f"model.{name}" for name in theirs)
        for name, flat in theirs.items():
            shape = SHAPES[stem][name]
            fetched = remote.tensor(f"model.{name}", shape, flat.dtype)
            assert same_bits(fetched, flat.reshape(shape)), name
            assert torch.isfinite(fetched).all() and fetched.abs().sum() > 0
        # The same pair without shapes: flat entries of the same sizes.
        client.store(f"{stem}-flat", tannery.load_tannic(tannic_nn / stem))
        flat_sizes = {e.name: e.nbytes for e in client.describe(f"{stem}-flat")}
        assert flat_sizes == {name: t.numel() * 4 for name, t in theirs.items()}


def test_a_module_loads_its_weights_from_a_stored_pytannic_pair(server, tannic_nn):
    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layer = torch.nn.Linear(784, 512)
            self.output_layer = torch.nn.Linear(512, 10)

    model = MLP()
    with tannery.Client(server.target) as client:
        client.store("mlp", tannery.load_tannic(tannic_nn / "MLP", like=model.state_dict()), prefix="net")
        client.load_state_dict(model, "mlp", prefix="net")
    theirs = pytannic_read(tannic_nn / "MLP")
    for name, tensor in model.state_dict().items():
        assert same_bits(tensor.reshape(-1), theirs[name]), name


# -- a channel between two processes ------------------------------------------------------------

PEER_CODE = """
import hashlib, json, sys, torch, tannery, tannery.aio, asyncio
role, target, count = sys.argv[1], sys.argv[2], int(sys.argv[3])

def frame(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(1000 * (i + 1), generator=g).to(torch.bfloat16 if i % 2 else torch.float32)

if role == "publish":
    with tannery.Client(target, chunk_size=100_000) as client:
        result = client.publish("between", (frame(i) for i in range(count)))
    print(json.dumps({"payloads": result.payloads, "bytes": result.nbytes}), flush=True)
else:
    async def main():
        async with tannery.aio.Client(target) as client:
            async with client.subscribe("between") as frames:
                print("subscribed", flush=True)
                got = []
                async for tensor in frames:
                    got.append([str(tensor.dtype), list(tensor.shape),
                                hashlib.sha256(tannery.torch.serialize(tensor)).hexdigest()])
                    if len(got) == count:
                        break
        print(json.dumps(got), flush=True)
    asyncio.run(main())
"""


def peer(role: str, target: str, count: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PEER_CODE, role, target, str(count)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env={**os.environ})


@pytest.mark.slow
def test_a_channel_between_two_processes(server):
    count = 12
    subscriber = peer("subscribe", server.target, count)
    try:
        assert subscriber.stdout.readline().strip() == "subscribed"
        publisher = peer("publish", server.target, count)
        published, _ = publisher.communicate(timeout=120)
        received, _ = subscriber.communicate(timeout=120)
    finally:
        if subscriber.poll() is None:
            subscriber.kill()
    assert publisher.returncode == 0 and subscriber.returncode == 0

    def frame(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return torch.randn(1000 * (i + 1), generator=g).to(torch.bfloat16 if i % 2 else torch.float32)

    expected = [frame(i) for i in range(count)]
    assert json.loads(published) == {"payloads": count, "bytes": sum(len(serialize(t)) for t in expected)}
    assert json.loads(received) == [
        [str(t.dtype), list(t.shape), hashlib.sha256(serialize(t)).hexdigest()] for t in expected
    ]


REFUSED_STORE = """
import sys, torch, tannery
with tannery.Client(sys.argv[1]) as client:
    try:
        client.store("taken", {"w": torch.zeros(1 << 20)})
    except tannery.AlreadyExists:
        print("refused")
"""


@pytest.mark.slow
def test_a_program_whose_store_is_refused_exits_cleanly(server):
    """gRPC's request-sending thread outlives a refused upload by up to 0.1 s; a program that
    exits meanwhile aborted inside gRPC's C++ code (SIGABRT) about one run in three."""
    with tannery.Client(server.target) as client:
        client.store("taken", {"w": torch.zeros(4)})
    for _ in range(8):  # one after the other: in parallel the abort hardly ever shows
        run = subprocess.run([sys.executable, "-c", REFUSED_STORE, server.target], capture_output=True, text=True,
                             timeout=120)
        assert (run.returncode, run.stdout.strip()) == (0, "refused"), run.stderr[-2000:]
