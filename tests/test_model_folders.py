"""A model folder round-trips (issue 29): ``tannery push DIR`` of a folder as
``save_pretrained`` writes it keeps its other files (config, tokenizer, README) with the
archive, ``pull -o DIR/`` writes them back byte for byte, ``show`` lists them; both storage
backends, every transport. The files are entries ``@file:NAME`` on the server, never listed
among the tensors (docs/model-folders.md)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

import tannery.aio
from tannery import Client
from tannery.calls.archive_files import MAX_FILE_BYTES, file_bytes
from tannery.records import FileDescription
from tannery_protocol.errors import ArchiveError, DataLoss

from .server_harness import running_server
from .test_cli import Cli, _clean_env  # noqa: F401: the fixture clears TANNERY_* for every test here
from .test_hf_shards import INDEX, _state, write_sharded

#: The files of a GPT-2 folder beside its weights, as save_pretrained and the tokenizer write them.
FILES = {
    "config.json": json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 4,
                               "torch_dtype": "float32"}, indent=2).encode() + b"\n",
    "generation_config.json": b'{\n  "bos_token_id": 50256,\n  "eos_token_id": 50256\n}\n',
    "tokenizer.json": json.dumps({"version": "1.0", "model": {"vocab": {f"t{i}": i for i in range(3000)}}}).encode(),
    "tokenizer_config.json": b'{"model_max_length": 1024, "tokenizer_class": "GPT2Tokenizer"}',
    "special_tokens_map.json": "{\"eos_token\": \"<|endoftext|>\", \"note\": \"\u00e9t\u00e9\"}".encode(),
    "vocab.json": b'{"a": 0, "b": 1}',
    "merges.txt": b"#version: 0.2\r\na b\r\n",  # CRLF kept as is
    "README.md": b"# tiny gpt2\n",
    "tokenizer.model": bytes(range(256)) * 400,  # binary, every byte value
    "added_tokens.json": b"",  # empty
}


def _folder(directory: Path, shards: int = 3) -> dict[str, torch.Tensor]:
    state = _state()
    write_sharded(directory, state, shards=shards)
    for name, data in FILES.items():
        (directory / name).write_bytes(data)
    return state


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(safetensors.torch.load_file(shard))
    return tensors


def _others(directory: Path) -> dict[str, bytes]:
    """Every file of the folder but the weights (shards and index), by name, with its bytes."""
    return {p.name: p.read_bytes() for p in directory.iterdir()
            if p.is_file() and not p.name.endswith(".safetensors") and p.name != INDEX}


@pytest.mark.parametrize("transport", ["grpc", "local", "tcp"])
def test_a_pushed_folder_pulls_back_with_every_file_byte_for_byte(tmp_path, backend, transport, capsys):
    state = _folder(tmp_path / "in")
    with running_server(tmp_path, **backend) as server:
        cli = Cli(server.target, capsys)
        out = cli.ok("--transport", transport, "push", str(tmp_path / "in"), "--as", "gpt2")
        assert f"3 shards, {len(FILES)} files" in out and f"{len(state)} entries" in out, out
        assert f"and {len(FILES)} files" in out, out

        out = cli.ok("--transport", transport, "pull", "gpt2", "-o", str(tmp_path / "out") + "/",
                     "--max-shard-size", "2KB")
        assert f"{len(FILES)} files" in out, out
        assert _others(tmp_path / "out") == FILES  # byte for byte, the empty file and the binary one too
        pulled = _weights(tmp_path / "out")
        assert set(pulled) == set(state)
        for name, tensor in state.items():
            assert pulled[name].dtype == tensor.dtype and torch.equal(pulled[name], tensor), name
        index = json.loads((tmp_path / "out" / INDEX).read_text())
        assert set(index["weight_map"]) == set(state)

        with Client(server.target, transport=transport) as client:
            # The library: the files apart from the tensors, never among them.
            description = client.describe("gpt2")
            assert sorted(e.name for e in description) == sorted(state)
            assert {f.name: f.size for f in description.files} == {n: len(d) for n, d in FILES.items()}
            assert client.files("gpt2") == FILES
            assert sorted(client.fetch("gpt2").names()) == sorted(state)
            assert sorted(name for name, _ in client.fetch_iter("gpt2")) == sorted(state)
            assert sorted(client.archive("gpt2").names()) == sorted(state)
            assert len(client.archive("gpt2", lazy=False)) == len(state)
            assert "@file:config.json" not in client.archive("gpt2")
            module = torch.nn.Module()
            for name, tensor in state.items():  # a module with exactly the state's keys: strict loading works
                *path, leaf = name.split(".")
                owner = module
                for part in path:
                    if not hasattr(owner, part):
                        owner.add_module(part, torch.nn.Module())
                    owner = getattr(owner, part)
                owner.register_buffer(leaf, torch.zeros_like(tensor))
            missing, unexpected = client.load_state_dict(module, "gpt2")
            assert (missing, unexpected) == ([], [])
            assert torch.equal(module.get_buffer("model.embed.weight"), state["model.embed.weight"])

        # The async client: the same files.
        async def files() -> dict[str, bytes]:
            async with tannery.aio.Client(server.target, transport=transport) as client:
                return await client.files("gpt2")

        assert asyncio.run(files()) == FILES


def test_show_lists_the_files_and_a_plain_checkpoint_is_unchanged(tmp_path, backend, capsys):
    _folder(tmp_path / "in")
    plain = {"w": torch.arange(6.0).reshape(2, 3)}
    safetensors.torch.save_file(plain, tmp_path / "plain.safetensors", metadata={"format": "pt"})
    with running_server(tmp_path, **backend) as server:
        cli = Cli(server.target, capsys)
        cli.ok("push", str(tmp_path / "in"), "--as", "gpt2")
        text = cli.ok("show", "gpt2")
        assert "FILE" in text and f"{len(FILES)} files kept with the archive" in text
        assert "config.json" in text and "@file:" not in text
        shown = cli.json("show", "gpt2")
        assert {f["name"]: f["size"] for f in shown["files"]} == {n: len(d) for n, d in FILES.items()}
        assert all(f["prefix"] == "" and len(f["digest"]) == 64 for f in shown["files"])
        assert not any(e["name"].startswith("@file:") for e in shown["entries"])

        # A plain safetensors file: no files, pulled back exactly as before.
        pushed = cli.json("push", str(tmp_path / "plain.safetensors"), "--as", "plain")
        assert pushed["files"] == [] and pushed["entries"] == 1
        assert cli.json("show", "plain")["files"] == []
        assert "FILE" not in cli.ok("show", "plain")
        cli.ok("pull", "plain", "-o", str(tmp_path / "plain-out.safetensors"))
        assert (tmp_path / "plain-out.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()
        cli.ok("pull", "plain", "-o", str(tmp_path / "plain-dir") + "/")
        assert sorted(p.name for p in (tmp_path / "plain-dir").iterdir()) == ["model.safetensors"]

        # --no-files: the weights alone, both ways.
        out = cli.ok("push", str(tmp_path / "in"), "--as", "weights-only", "--no-files")
        assert out.rstrip().endswith("(3 shards) as weights-only: 15 entries, 8.5 KiB"), out
        assert cli.json("show", "weights-only")["files"] == []
        cli.ok("pull", "gpt2", "-o", str(tmp_path / "bare") + "/", "--no-files")
        assert _others(tmp_path / "bare") == {}

        # Into one file: the files are not written, and the command says where they would be.
        code, out, err = cli("pull", "gpt2", "-o", str(tmp_path / "one.safetensors"))
        assert code == 0 and "keeps 10 files" in err and "-o DIR/" in err


def test_files_over_the_bounds_are_refused_naming_the_file_and_the_remedy(tmp_path, capsys, server):
    _folder(tmp_path / "in", shards=2)
    with open(tmp_path / "in" / "pytorch_model.bin", "wb") as big:  # sparse: no 32 MiB written
        big.truncate(MAX_FILE_BYTES + 1)
    cli = Cli(server.target, capsys)
    error = cli.fails("push", str(tmp_path / "in"), "--as", "m")
    assert "pytorch_model.bin" in error and str(MAX_FILE_BYTES + 1) in error and "32.0 MiB" in error, error
    assert "--exclude pytorch_model.bin" in error and "--no-files" in error, error
    assert cli.json("ls") == []  # nothing stored

    for i in range(3):  # 3 x 30 MiB: each under the bound of one file, over 64 MiB in all
        with open(tmp_path / "in" / f"extra-{i}.bin", "wb") as extra:
            extra.truncate(30 << 20)
    error = cli.fails("push", str(tmp_path / "in"), "--as", "m", "--exclude", "pytorch_model.bin")
    assert "64.0 MiB in all" in error and "extra-2.bin" in error, error

    out = cli.ok("push", str(tmp_path / "in"), "--as", "m", "--exclude", "*.bin")
    assert f"{len(FILES)} files" in out
    assert {f["name"] for f in cli.json("show", "m")["files"]} == set(FILES)

    with Client(server.target) as client:  # the library's bounds: the same, naming the file
        with pytest.raises(ArchiveError, match="'huge.txt' is 33554433 bytes, over the bound of 33554432"):
            client.store("lib", {"w": torch.ones(2)}, files={"huge.txt": b"x" * (MAX_FILE_BYTES + 1)})
        with pytest.raises(ArchiveError, match="not a plain file name"):
            client.store("lib", {"w": torch.ones(2)}, files={"sub/a.txt": b"x"})
        with pytest.raises(ArchiveError, match="reserved for the files kept with an archive"):
            client.store("lib", {"@file:config.json": torch.ones(2)})
        with pytest.raises(ArchiveError, match="'enc.@file:x'.*reserved"):
            client.store("lib", {"enc.@file:x": torch.ones(2)})
        assert [a.name for a in client.list()] == ["m"]


def test_files_commit_with_the_archive_and_follow_it_through_replace_union_and_delete(tmp_path, backend, capsys):
    _folder(tmp_path / "in")
    (tmp_path / "in" / "notes").mkdir()  # a directory: left out, and said so
    with running_server(tmp_path, **backend) as server:
        cli = Cli(server.target, capsys)
        code, out, err = cli("push", str(tmp_path / "in"), "--as", "gpt2")
        assert code == 0 and "left out notes" in err, err
        (tmp_path / "in" / "notes").rmdir()

        # Another config under the same name: refused whole, naming the file's entry; --replace replaces it.
        (tmp_path / "in" / "config.json").write_bytes(b'{"n_layer": 5}')
        error = cli.fails("push", str(tmp_path / "in"), "--as", "gpt2")
        assert "@file:config.json" in error, error
        with Client(server.target) as client:
            assert client.files("gpt2")["config.json"] == FILES["config.json"]
        cli.ok("push", str(tmp_path / "in"), "--as", "gpt2", "--replace")
        with Client(server.target) as client:
            assert client.files("gpt2")["config.json"] == b'{"n_layer": 5}'

            # A union keeps the files: those of a source under a prefix, under that prefix.
            client.union("both", {"": "gpt2", "copy": "gpt2"})
            described = client.describe("both")
            assert {(f.prefix, f.name) for f in described.files} == {(p, n) for p in ("", "copy") for n in FILES}
            assert client.files("both", "copy")["config.json"] == b'{"n_layer": 5}'
        cli.ok("pull", "both", "--prefix", "copy", "-o", str(tmp_path / "copy") + "/")
        assert set(_others(tmp_path / "copy")) == set(FILES)
        assert all(name.startswith("copy.") for name in _weights(tmp_path / "copy"))

        # Deleted with the archive.
        cli.ok("rm", "gpt2", "both")
        assert cli.json("ls") == []


def test_a_file_whose_bytes_do_not_match_its_digest_is_data_loss():
    data = b'{"model_type": "gpt2"}'
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    from tannery.torch import serialize_parts

    right = hashlib.sha256(b"".join(bytes(memoryview(p).cast("B")) for p in serialize_parts(tensor))).hexdigest()
    assert file_bytes(FileDescription("config.json", "", len(data), right, "@file:config.json"), tensor) == data
    wrong = FileDescription("config.json", "", len(data), "0" * 64, "@file:config.json")
    with pytest.raises(DataLoss, match="config.json"):
        file_bytes(wrong, tensor)


def test_from_pretrained_loads_the_pulled_folder(tmp_path, server, capsys):
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100))
    model.save_pretrained(tmp_path / "in", max_shard_size="20KB")
    cli = Cli(server.target, capsys)
    cli.ok("push", str(tmp_path / "in"), "--as", "gpt2")
    cli.ok("pull", "gpt2", "-o", str(tmp_path / "out") + "/")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert os.path.exists(tmp_path / "out" / "generation_config.json")
