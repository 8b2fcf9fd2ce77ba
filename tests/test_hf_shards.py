"""Sharded Hugging Face checkpoints (issue 17, part 2): a folder of shards and its index pushed
as one archive, pulled back as shards and an index the safetensors package loads as they
are, and archive metadata (safetensors' ``__metadata__``) through Store, Describe, show,
push and pull."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from tannery import Client
from tannery.cli.hf import parse_size, plan_shards
from tannery_protocol.errors import InvalidArgument

from .test_cli import Cli, _clean_env  # noqa: F401: the fixture clears TANNERY_* for every test here

INDEX = "model.safetensors.index.json"


@pytest.fixture
def cli(server, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(server.target, capsys)


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(17)
    state = {}
    for layer in range(4):
        state[f"model.layers.{layer}.attn.weight"] = torch.randn(16, 16)
        state[f"model.layers.{layer}.attn.bias"] = torch.randn(16, dtype=torch.bfloat16)
        state[f"model.layers.{layer}.norm.weight"] = torch.ones(16, dtype=torch.float16)
    state["model.embed.weight"] = torch.randn(64, 16)
    state["model.mask"] = torch.tensor([True, False, True, True])
    state["lm_head.weight"] = torch.arange(32, dtype=torch.int64).reshape(4, 8)
    return state


def write_sharded(directory: Path, state: dict[str, torch.Tensor], shards: int = 3,
                  metadata: dict[str, str] | None = None) -> dict[str, str]:
    """The state in ``shards`` files and an index, as transformers' save_pretrained writes them
    (tensors in insertion order, cut into consecutive groups); the weight_map."""
    directory.mkdir(parents=True, exist_ok=True)
    names = list(state)
    per = -(-len(names) // shards)
    weight_map = {}
    for index in range(shards):
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: state[name] for name in names[index * per : (index + 1) * per]}
        safetensors.torch.save_file(part, directory / file, metadata=metadata or {"format": "pt"})
        weight_map.update({name: file for name in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return weight_map


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_sharded_checkpoint_pushed_as_one_archive_and_pulled_back_as_shards(cli: Cli, server, tmp_path):
    state = _state()
    write_sharded(tmp_path / "in", state, shards=3)
    out = cli.ok("push", str(tmp_path / "in"), "--as", "llm")
    assert "3 shards" in out and f"{len(state)} entries" in out

    with Client(server.target) as client:
        description = client.describe("llm")
        assert description.metadata == {"format": "pt"}
        assert sorted(e.name for e in description) == sorted(state)

    # A max shard size that cuts the 4.6 KiB of tensors into several shards.
    out = cli.ok("pull", "llm", "-o", str(tmp_path / "out") + "/", "--max-shard-size", "2KB")
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 3 and INDEX in files, files
    assert shards == [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    assert sorted(index["weight_map"]) == sorted(state)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())

    loaded: dict[str, torch.Tensor] = {}
    for shard in shards:
        path = tmp_path / "out" / shard
        tensors = safetensors.torch.load_file(path)
        assert {n for n, s in index["weight_map"].items() if s == shard} == set(tensors)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 2000 or len(tensors) == 1, (shard, size)
        with safe_open(path, "pt") as f:
            assert f.metadata() == {"format": "pt"}
        loaded.update(tensors)
    assert sorted(loaded) == sorted(state)
    for name, tensor in state.items():
        assert _same(loaded[name], tensor), name

    # Pushed again from the pulled folder: the same entries, byte for byte.
    cli.ok("push", str(tmp_path / "out"), "--as", "again")
    with Client(server.target) as client:
        assert ([(e.name, e.digest) for e in client.describe("again")]
                == [(e.name, e.digest) for e in client.describe("llm")])
        assert client.describe("again").metadata == {"format": "pt"}


def test_a_pull_that_fits_in_one_shard_and_into_an_existing_directory(cli: Cli, tmp_path):
    state = _state()
    write_sharded(tmp_path / "in", state, shards=2)
    cli.ok("push", str(tmp_path / "in"), "--as", "llm")
    (tmp_path / "out").mkdir()
    cli.ok("pull", "llm", "-o", str(tmp_path / "out"))  # an existing directory, no slash; 5GB by default
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    loaded = safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")
    assert all(_same(loaded[name], tensor) for name, tensor in state.items()) and len(loaded) == len(state)
    # A single model.safetensors folder is pushed too; a second pull refuses to overwrite.
    cli.ok("push", str(tmp_path / "out"), "--as", "single")
    assert "exists" in cli.error("pull", "llm", "-o", str(tmp_path / "out") + "/")
    cli.ok("pull", "llm", "-o", str(tmp_path / "out") + "/", "--force")


def test_an_entry_larger_than_the_maximum_gets_a_shard_of_its_own():
    class E:
        def __init__(self, name, n):
            self.name, self.dtype, self.shape = name, "float32", (n,)

    plan = plan_shards([E("a", 10), E("b", 1000), E("c", 10), E("d", 10)], 100)
    assert [[e.name for e in shard] for shard in plan] == [["a"], ["b"], ["c", "d"]]
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("100") == 100


def test_an_index_naming_a_missing_shard_is_refused(cli: Cli, tmp_path):
    write_sharded(tmp_path / "in", _state(), shards=3)
    (tmp_path / "in" / "model-00002-of-00003.safetensors").unlink()
    err = cli.fails("push", str(tmp_path / "in"), "--as", "x")
    assert "the index names shard 'model-00002-of-00003.safetensors'" in err and "which is not in" in err
    assert "hint: download every shard" in err
    assert "x" not in [a.name for a in Client(cli.target).list()]


def test_a_tensor_in_the_wrong_shard_is_refused(cli: Cli, tmp_path):
    weight_map = write_sharded(tmp_path / "in", _state(), shards=3)
    index = json.loads((tmp_path / "in" / INDEX).read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors"
    (tmp_path / "in" / INDEX).write_text(json.dumps(index))
    err = cli.fails("push", str(tmp_path / "in"), "--as", "x")
    assert (f"the index puts tensor 'lm_head.weight' in 'model-00001-of-00003.safetensors', but it is in "
            f"{weight_map['lm_head.weight']!r}") in err
    assert "hint: fix the weight_map" in err


def test_a_tensor_the_index_does_not_list_or_does_not_hold_is_refused(cli: Cli, tmp_path):
    write_sharded(tmp_path / "in", _state(), shards=3)
    index = json.loads((tmp_path / "in" / INDEX).read_text())
    del index["weight_map"]["model.mask"]
    (tmp_path / "in" / INDEX).write_text(json.dumps(index))
    err = cli.fails("push", str(tmp_path / "in"), "--as", "x")
    assert "holds tensor 'model.mask', which the index does not list" in err

    index["weight_map"]["model.mask"] = index["weight_map"]["lm_head.weight"]
    index["weight_map"]["model.ghost"] = "model-00001-of-00003.safetensors"
    (tmp_path / "in" / INDEX).write_text(json.dumps(index))
    err = cli.fails("push", str(tmp_path / "in"), "--as", "x")
    assert "the index puts tensor 'model.ghost' in 'model-00001-of-00003.safetensors', which does not hold it" in err


def test_metadata_through_store_describe_show_union_and_single_file_push_pull(cli: Cli, server, tmp_path):
    safetensors.torch.save_file({"w": torch.ones(3)}, tmp_path / "one.safetensors",
                                metadata={"format": "pt", "note": "é"})
    cli.ok("push", str(tmp_path / "one.safetensors"), "--as", "one")
    assert cli.json("show", "one")["metadata"] == {"format": "pt", "note": "é"}
    assert "metadata: format=pt, note=é" in cli.ok("show", "one")
    cli.ok("pull", "one", "-o", str(tmp_path / "back.safetensors"))
    with safe_open(tmp_path / "back.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "é"}

    with Client(server.target) as client:
        client.store("plain", {"w": torch.zeros(2)})
        assert client.describe("plain").metadata == {}
        assert cli.json("show", "plain")["metadata"] == {}
        client.store("m", {"w": torch.zeros(2)}, metadata={"a": "1"})
        assert client.describe("m").metadata == {"a": "1"}
        client.union("u", {"a": "one", "b": "plain"}, metadata={"made": "by union"})
        assert client.describe("u").metadata == {"made": "by union"}
        client.union("u2", {"x": "one"})
        assert client.describe("u2").metadata == {}  # a union's metadata is its request's, never its sources'
        with pytest.raises(InvalidArgument, match="metadata: 65 keys, over the limit of 64"):
            client.store("big", {"w": torch.zeros(2)}, metadata={f"k{i}": "v" for i in range(65)})
        with pytest.raises(InvalidArgument, match="over the limit of 65536 bytes"):
            client.store("big", {"w": torch.zeros(2)}, metadata={"k": "v" * 70000})
        with pytest.raises(TypeError, match="metadata maps str to str"):
            client.store("big", {"w": torch.zeros(2)}, metadata={"k": 1})
        assert "big" not in [a.name for a in client.list()]


@pytest.mark.parametrize("transport", ["grpc", "local", "tcp"])
def test_metadata_is_stored_on_every_transport_and_by_the_asyncio_client(server, transport):
    import asyncio

    import tannery.aio

    with Client(server.target, transport=transport) as client:
        assert client.transport == transport
        client.store("t", {"w": torch.ones(2)}, metadata={"format": "pt"})
        assert client.describe("t").metadata == {"format": "pt"}

    async def main():
        async with tannery.aio.Client(server.target, transport=transport) as client:
            await client.store("a", {"w": torch.ones(2)}, metadata={"k": "v"})
            await client.union("au", ["a"], metadata={"u": "1"})
            return (await client.describe("a")).metadata, (await client.describe("au")).metadata

    assert asyncio.run(main()) == ({"k": "v"}, {"u": "1"})
