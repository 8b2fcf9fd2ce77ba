"""A newcomer's surprises, each pinned down: values that are not tensors no longer vanish,
messages say what is wrong in words and what to do, and writes into new directories work.
The command runs in-process against a real server on loopback, as in tests/test_cli.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tannery
from tannery.cli import main

from .test_cli import Cli


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TANNERY_TARGET", "TANNERY_TOKEN", "TANNERY_TLS", "TANNERY_TLS_CA", "TANNERY_CLIENT_CERT",
                 "TANNERY_CLIENT_KEY", "TANNERY_DEBUG", "TANNERY_TRANSPORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def cli(server, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(server.target, capsys)


# -- values that are not tensors ----------------------------------------------------------------


def test_push_of_a_torch_file_lists_the_values_it_left_out(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "mixed.pt"
    torch.save({"w": torch.ones(3), "step": 5, "name": "x", "opt": {"lr": 0.1, "m": [torch.zeros(1)]}}, path)
    code, out, err = cli("push", str(path), "--as", "mixed")
    assert code == 0
    assert out == f"pushed {path} as mixed: 2 entries, 16 B\n"
    assert err == ("warning: left out 3 values that are not tensors (an archive holds tensors only): "
                   "step (int), name (str), opt.lr (float)\n")
    # --quiet silences progress, not this
    code, out, err = cli("push", str(path), "--as", "mixed", "--replace", "-q")
    assert code == 0 and err.startswith("warning: left out 3 values")

    code, out, err = cli("push", str(path), "--as", "mixed2", "--json")
    assert code == 0 and err.startswith("warning: left out 3 values")
    shown = json.loads(out)
    assert (shown["name"], shown["entries"], shown["nbytes"]) == ("mixed2", 2, 16)
    assert shown["skipped"] == [{"name": "step", "type": "int"}, {"name": "name", "type": "str"},
                                {"name": "opt.lr", "type": "float"}]
    clean = tmp_path / "clean.pt"
    torch.save({"w": torch.ones(3)}, clean)
    assert json.loads(cli.ok("push", str(clean), "--as", "clean", "--json"))["skipped"] == []


def test_push_help_says_what_happens_to_non_tensor_values(cli: Cli, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["push", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "push stores the tensors and lists the values it left out, with their types, on stderr" in text
    assert '"skipped" with --json' in text


def test_push_of_a_torch_file_of_no_tensors_says_what_it_holds(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "notatensor.pt"
    torch.save("notatensor", path)
    assert cli.error("push", str(path), "--as", "x") == (
        f"tannery push: error: {path}: no tensors in the checkpoint: it holds a str, not a dict of tensors\n")
    torch.save({"step": 3, "name": "x"}, path)
    assert cli.error("push", str(path), "--as", "x") == (
        f"tannery push: error: {path}: no tensors in the checkpoint (a dict of step (int), name (str))\n")
    assert cli.json("ls") == []


# -- writes into directories that are not there yet -----------------------------------------------


def test_writes_create_missing_parent_directories(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 3)
    tannery.torch.write(model, tmp_path / "ckpt" / "model")
    assert set(tannery.torch.read(tmp_path / "ckpt" / "model")) == {"weight", "bias"}
    archive = tannery.Archive.of_list({"w": torch.ones(2)})
    tannery.save_safetensors(tmp_path / "a" / "b" / "m.safetensors", archive)
    tannery.save_tannic(tmp_path / "c" / "m", archive)
    assert tannery.load_safetensors(tmp_path / "a" / "b" / "m.safetensors").names() == ["w"]
    (tmp_path / "file").write_text("in the way")
    with pytest.raises(NotADirectoryError) as e:
        tannery.torch.write(model, tmp_path / "file" / "model")
    assert e.value.filename == str(tmp_path / "file") and "a file is in the way" in str(e.value)
