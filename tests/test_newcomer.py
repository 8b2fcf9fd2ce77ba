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


def test_push_help_is_short_and_lists_every_json_key(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        main(["push", "--help"])
    text = capsys.readouterr().out
    described = text[text.index("\n\n") + 2:text.index(" push --json prints")]  # before the JSON keys
    assert len(described.splitlines()) <= 12, described
    keys = text[text.index("push --json prints {"):].split("}:", 1)[0]
    assert all(key in keys for key in ("entries", "nbytes", "skipped", "files", "already_stored"))


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


# -- messages that say what is wrong, and what to do ------------------------------------------------


def test_a_file_torch_cannot_load_is_explained_in_words(cli: Cli, tmp_path: Path) -> None:
    import pickle

    text = tmp_path / "notatensor.pt"
    text.write_text("everything")  # 'e' is pickle's APPENDS: torch's own reason is a bare opcode or an IndexError
    err = cli.fails("push", str(text), "--as", "x")
    assert (f"{text}: not a checkpoint torch.load(weights_only=True) can read: it is not a file torch.save wrote: "
            "it starts with b'everythi', neither a zip archive (torch.save's format) nor a pickle") in err
    assert "hint: push a file torch.save wrote from a dict of tensors" in err
    plain = tmp_path / "plain.pt"
    plain.write_bytes(pickle.dumps("notatensor", protocol=4))
    err = cli.error("push", str(plain), "--as", "x")
    assert "a pickle, not a file torch.save wrote" in err and "instruction FRAME (byte 149)" in err, err
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert cli.error("push", str(empty), "--as", "x").endswith("can read: the file is empty (0 bytes)\n")


def test_an_empty_safetensors_file_is_called_empty(cli: Cli, tmp_path: Path) -> None:
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    assert cli.error("push", str(empty), "--as", "x") == (
        f"tannery push: error: {empty}: the file is empty (0 bytes); a safetensors file starts with an 8-byte "
        "header length\n")
    empty.write_bytes(bytes(8))
    assert cli.error("push", str(empty), "--as", "x") == (
        f"tannery push: error: {empty}: the header is empty (its length is 0); a safetensors header is a JSON object\n")


def test_a_malformed_target_is_called_malformed_with_no_retry_hint(capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["--target", "notahost:xx", "ls"]) == 1
    assert capsys.readouterr().err == (
        "tannery ls: error: --target notahost:xx: a malformed address: HOST:PORT expected, the port a number\n"
        "hint: give the server's address as HOST:PORT, e.g. --target localhost:50051 (or TANNERY_TARGET)\n")
    monkeypatch.setenv("TANNERY_TARGET", "box:")
    assert main(["ls"]) == 1
    assert capsys.readouterr().err.startswith("tannery ls: error: TANNERY_TARGET=box:: a malformed address")


def test_data_loss_says_how_to_find_and_repair_the_damage(cli: Cli, server, tmp_path: Path) -> None:
    tannery.Client(server.target).store("m", {"w": torch.arange(10_000.0)})
    digest = cli.json("show", "m")["entries"][0]["digest"]
    path = server.data_dir / "blobs" / digest[:2] / digest
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    hint = cli.hint("get", "m", "w")
    assert "tannery scrub" in hint and "push those archives again" in hint


def test_hints_quote_names_for_the_shell(cli: Cli, tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "s.pt")
    cli.ok("push", str(tmp_path / "s.pt"), "--as", "my model")
    assert cli.hint("get", "my model", "x") == "tannery show 'my model' lists its entries"
    assert cli.hint("pull", "my model", "-o", str(tmp_path / "o.safetensors"), "--names", "x") == (
        "tannery show 'my model' lists its entries")


def test_a_mistyped_archive_name_gets_a_did_you_mean(cli: Cli, tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "s.pt")
    cli.ok("push", str(tmp_path / "s.pt"), "--as", "resnet50")
    for argv in (("show", "resnet05"), ("get", "resnet05", "w"), ("rm", "resnet05"),
                 ("pull", "resnet05", "-o", str(tmp_path / "o.safetensors"))):
        assert cli.fails(*argv) == (
            f"tannery {argv[0]}: error: archive 'resnet05' not found; did you mean 'resnet50'?\n"
            "hint: tannery ls lists the archives on the server\n")
    assert cli.error("show", "zzz") == "tannery show: error: archive 'zzz' not found\n"


@pytest.fixture
def server_logging():
    """The server's logger as it was: ``tannery serve`` in-process points it at the captured stderr."""
    import logging

    logger = logging.getLogger("tannery_server")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


def test_a_busy_data_or_metrics_port_is_said_in_words(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      server_logging: None) -> None:
    import socket

    from tannery_server.cli import main as serve_main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = str(taken.getsockname()[1])
        for flag in ("--metrics-port", "--data-port"):
            argv = ["serve", "--host", "127.0.0.1", "--port", "0", "--data-dir", str(tmp_path / flag), flag, busy]
            if flag == "--data-port":
                argv += ["--metrics-port", "0"]
            assert serve_main(argv) == 1
            line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("tannery serve:")][0]
            assert "[Errno" not in line and f"127.0.0.1:{busy}: Address already in use" in line, line


# -- cosmetics ---------------------------------------------------------------------------------------


def test_ls_shortens_a_long_name_in_the_table_and_keeps_it_whole_in_json(cli: Cli, tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "s.pt")
    long_name = "x" * 300
    cli.ok("push", str(tmp_path / "s.pt"), "--as", long_name)
    cli.ok("push", str(tmp_path / "s.pt"), "--as", "模型权重")
    lines = cli.ok("ls").splitlines()
    assert max(len(line) for line in lines) < 120, lines
    assert any(line.startswith("x" * 59 + "…") for line in lines)
    from tannery.cli.output import cell_width

    # columns line up by display width: ENTRIES ends at the same column on every row
    ends = {cell_width(line[: line.index(" 1 ") + 2]) for line in lines[1:]}
    assert len(ends) == 1, lines
    assert {a["name"] for a in cli.json("ls")} == {long_name, "模型权重"}


def test_as_takes_a_name_that_starts_with_a_dash(cli: Cli, tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "s.pt")
    assert cli.ok("push", str(tmp_path / "s.pt"), "--as", "-dash").startswith(f"pushed {tmp_path / 's.pt'} as -dash:")
    assert [a["name"] for a in cli.json("ls")] == ["-dash"]


# -- pull -o FILE.pt, as push FILE.pt and get -o FILE.pt ---------------------------------------------


def test_pull_writes_a_torch_checkpoint_that_pushes_back_the_same(cli: Cli, tmp_path: Path) -> None:
    state = {"layer.weight": torch.randn(3, 4), "layer.bias": torch.zeros(3, dtype=torch.bfloat16),
             "mask": torch.tensor([True, False, True, True, False, False, True, False, True]),
             "z": torch.tensor([1 + 2j], dtype=torch.complex64)}
    torch.save(state, tmp_path / "head.pt")
    cli.ok("push", str(tmp_path / "head.pt"), "--as", "head")
    out = cli.ok("pull", "head", "-o", str(tmp_path / "back" / "back.pt"))
    assert out == f"pulled head into {tmp_path / 'back' / 'back.pt'}: 4 entries, 64 B\n"
    back = torch.load(tmp_path / "back" / "back.pt", weights_only=True)
    assert list(back) == sorted(state) and all(torch.equal(back[k], v) and back[k].dtype == v.dtype
                                               for k, v in state.items())
    assert not [p.name for p in (tmp_path / "back").iterdir() if p.name != "back.pt"]  # no staging file left
    assert "already stored with this content" in cli.ok("push", str(tmp_path / "back" / "back.pt"), "--as", "head")
    assert "exists" in cli.fails("pull", "head", "-o", str(tmp_path / "back" / "back.pt"))
    only = cli.ok("pull", "head", "-o", str(tmp_path / "bias.pth"), "--names", "layer.bias")
    assert only.endswith(": 1 entry, 6 B\n")
    assert list(torch.load(tmp_path / "bias.pth", weights_only=True)) == ["layer.bias"]
