"""One meaning of "entries": the tensors. The files kept with an archive (a pushed folder's
config.json...) are counted apart, the same in ``ls``, ``show``, ``push``, their ``--json``, a
Store's answer, Describe and List (issue 41: ``ls`` said 115 entries where ``show`` said 104 and
11 files). A real server on loopback, on both storage backends (the two catalogs count files
each in its SQL); a real folder; a union carries the files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import tannery

from .server_harness import running_server
from .test_cli import Cli

TENSORS = {"a.weight": torch.ones(2, 3), "a.bias": torch.zeros(3), "b": torch.arange(4, dtype=torch.int64)}
FILES = {"config.json": b'{"model_type": "tiny"}', "tokenizer.json": b"{}" * 50}
TENSOR_BYTES = 2 * 3 * 4 + 3 * 4 + 4 * 8
FILE_BYTES = sum(map(len, FILES.values()))


@pytest.fixture
def cli(tmp_path: Path, backend: dict, capsys: pytest.CaptureFixture[str]) -> Iterator[Cli]:
    with running_server(tmp_path, **backend) as server:
        yield Cli(server.target, capsys)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "tiny"
    path.mkdir()
    save_file(TENSORS, path / "model.safetensors")
    for name, data in FILES.items():
        (path / name).write_bytes(data)
    return path


def test_every_count_of_a_folder_says_tensors_and_files_apart(cli: Cli, folder: Path) -> None:
    pushed = json.loads(cli.ok("push", str(folder), "--as", "tiny", "--json"))
    assert (pushed["entries"], pushed["nbytes"], pushed["file_bytes"]) == (3, TENSOR_BYTES, FILE_BYTES)
    assert [f["name"] for f in pushed["files"]] == sorted(FILES)
    assert cli.ok("push", str(folder), "--as", "tiny") == (
        f"tiny is already stored with this content ({folder} (2 files): 3 entries, 68 B, and 2 files "
        f"({FILE_BYTES} B)): nothing new stored\n")

    listed = json.loads(cli.ok("ls", "--json"))
    assert [(a["name"], a["entries"], a["nbytes"], a["files"], a["file_bytes"]) for a in listed] == [
        ("tiny", 3, TENSOR_BYTES, 2, FILE_BYTES)]
    header, row = cli.ok("ls").splitlines()
    assert header.split() == ["NAME", "ENTRIES", "SIZE", "FILES", "CREATED"]
    assert row.split()[:5] == ["tiny", "3", "68", "B", "2"]

    shown = cli.ok("show", "tiny")
    assert "3 entries, 68 B" in shown and "2 files kept with the archive" in shown
    assert len(json.loads(cli.ok("show", "tiny", "--json"))["entries"]) == 3

    with tannery.Client(cli.target) as client:
        info = client.describe("tiny").info
        assert (info.entries, info.nbytes, info.files, info.file_bytes) == (3, TENSOR_BYTES, 2, FILE_BYTES)
        assert len(client.archive("tiny")) == 3
        union = client.union("both", {"x": "tiny", "": "tiny"})  # files under x. and at the top: 4 in all
        assert (union.entries, union.files, union.file_bytes) == (6, 4, 2 * FILE_BYTES)
        assert [(a.name, a.entries, a.files) for a in client.list()] == [("both", 6, 4), ("tiny", 3, 2)]


def test_an_archive_without_files_keeps_the_ls_columns_it_had(cli: Cli) -> None:
    with tannery.Client(cli.target) as client:
        stored = client.store("plain", TENSORS)
    assert (stored.entries, stored.files, stored.file_bytes) == (3, 0, 0)
    assert cli.ok("ls").splitlines()[0].split() == ["NAME", "ENTRIES", "SIZE", "CREATED"]
