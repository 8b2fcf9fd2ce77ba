"""The ``tannery`` command end to end against a real server on loopback, run in-process as
``main(argv)`` with its output captured: every subcommand and flag, --json output, error
lines and exit statuses, and checkpoints written by other programs (the safetensors
library, pytannic's .tannic pairs) pushed and fetched back tensor by tensor, bit for bit."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from tannery import Client, load_tannic
from tannery.cli import main


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TANNERY_TARGET", "TANNERY_TOKEN", "TANNERY_TLS", "TANNERY_TLS_CA", "TANNERY_CLIENT_CERT",
                 "TANNERY_CLIENT_KEY", "TANNERY_DEBUG"):
        monkeypatch.delenv(name, raising=False)


class Cli:
    """Runs ``tannery`` against one server: ``cli("ls", "--json")`` -> (status, stdout, stderr)."""

    def __init__(self, target: str, capsys: pytest.CaptureFixture[str]) -> None:
        self.target = target
        self.capsys = capsys

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = main(["--target", self.target, *argv])
        out, err = self.capsys.readouterr()
        return code, out, err

    def ok(self, *argv: str) -> str:
        code, out, err = self(*argv)
        assert (code, err) == (0, ""), f"tannery {' '.join(argv)}: {code} {err}"
        return out

    def fails(self, *argv: str) -> str:
        """The error line of a failing command (status 1, nothing on stdout), followed by the
        ``hint:`` line when it has one."""
        code, out, err = self(*argv)
        assert code == 1, f"tannery {' '.join(argv)} exited {code}: {out} {err}"
        lines = err.splitlines()
        assert out == "" and err.endswith("\n") and len(lines) in (1, 2), err
        assert lines[0].startswith(f"tannery {argv[0]}: error: ") or lines[0].startswith("tannery "), err
        assert len(lines) == 1 or lines[1].startswith("hint: "), err
        assert "Traceback" not in err
        return err

    def error(self, *argv: str) -> str:
        """The error line alone of a failing command."""
        return self.fails(*argv).splitlines()[0] + "\n"

    def hint(self, *argv: str) -> str:
        """The hint of a failing command (what to do), "" when it gives none."""
        lines = self.fails(*argv).splitlines()
        return lines[1].removeprefix("hint: ") if len(lines) == 2 else ""

    def json(self, *argv: str):
        return json.loads(self.ok(*argv, "--json"))


@pytest.fixture
def cli(server, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(server.target, capsys)


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)


#: A checkpoint of many dtypes, written by the safetensors library.
def _foreign_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(5, 6, generator=g) * 3
    return {
        "blocks.0.attn.weight": base,
        "blocks.0.attn.bias": torch.randn(6, generator=g).to(torch.float16),
        "blocks.0.norm": base.to(torch.bfloat16),
        "embed.fp8": base.clamp(-200, 200).to(torch.float8_e4m3fn),
        "embed.fp8b": base.to(torch.float8_e5m2),
        "ids": torch.arange(-10, 10, dtype=torch.int64).reshape(4, 5),
        "small": torch.arange(12, dtype=torch.int8).reshape(3, 4),
        "pixels": torch.randint(0, 255, (2, 3, 4), dtype=torch.uint8, generator=g),
        "u16": torch.arange(7, dtype=torch.int32).to(torch.uint16),
        "mask": torch.rand(13, generator=g) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
    }


# -- checkpoints written by other programs ---------------------------------------------------


def test_safetensors_file_pushed_then_every_tensor_fetched_by_name(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "foreign.safetensors"
    safetensors.torch.save_file(_foreign_state(), path)
    theirs = safetensors.torch.load_file(path)  # the writing program's own reading

    assert "pushed" in cli.ok("push", str(path), "--as", "foreign")
    shown = cli.json("show", "foreign")
    assert [e["name"] for e in shown["entries"]] == sorted(theirs)
    for entry in shown["entries"]:
        tensor = theirs[entry["name"]]
        assert entry["shape"] == list(tensor.shape)
        assert entry["nbytes"] == tensor.numel() * tensor.element_size() or entry["dtype"] == "bool"
    for name, tensor in theirs.items():
        out = tmp_path / f"{name}.pt"
        code, printed, err = cli("get", "foreign", name, "-o", str(out), "--json")
        assert code == 0 and err == f"wrote {out}\n"
        assert json.loads(printed)["shape"] == list(tensor.shape)
        assert _same(torch.load(out, weights_only=True), tensor), name


def test_pull_as_safetensors_and_tannic_reads_back_equal(cli: Cli, tmp_path: Path) -> None:
    state = _foreign_state()
    safetensors.torch.save_file(state, tmp_path / "in.safetensors")
    cli.ok("push", str(tmp_path / "in.safetensors"), "--as", "m")

    out = cli.ok("pull", "m", "-o", str(tmp_path / "out.safetensors"))
    assert out.startswith("pulled m into ") and "12 entries" in out
    back = safetensors.torch.load_file(tmp_path / "out.safetensors")
    assert back.keys() == state.keys() and all(_same(back[k], v) for k, v in state.items())

    cli.ok("pull", "m", "-o", str(tmp_path / "out.tannic"))
    pair = load_tannic(tmp_path / "out.tannic", like=state)
    assert pair.names() == sorted(state) and all(_same(pair.find(k), v) for k, v in state.items())


#: The entries of the peers' pairs (from the README beside them): stem -> (name, offset, nbytes).
TANNIC_NN = {
    "MLP": [("input_layer.weight", 0, 1605632), ("input_layer.bias", 1605632, 2048),
            ("output_layer.weight", 1607680, 20480), ("output_layer.bias", 1628160, 40)],
    "CNN": [("convolutional_layer.weight", 0, 1152), ("convolutional_layer.bias", 1152, 128),
            ("output_layer.weight", 1280, 1003520), ("output_layer.bias", 1004800, 40)],
    "dev-embd": [("weight", 0, 32768)],
}
HEADER_BYTES = 15


@pytest.mark.parametrize("stem", sorted(TANNIC_NN))
def test_tannic_pairs_pushed_then_fetched_byte_for_byte(cli: Cli, tannic_nn: Path, tmp_path: Path, stem: str) -> None:
    data = (tannic_nn / f"{stem}.tannic").read_bytes()
    cli.ok("push", str(tannic_nn / f"{stem}.tannic"), "--as", stem)
    shown = cli.json("show", stem)
    assert {e["name"]: (e["dtype"], e["shape"]) for e in shown["entries"]} == {
        name: ("float32", [nbytes // 4]) for name, _, nbytes in TANNIC_NN[stem]}
    for name, offset, nbytes in TANNIC_NN[stem]:
        out = tmp_path / f"{name}.npy"
        cli.ok("get", stem, name, "-o", str(out), "-q")
        raw = data[HEADER_BYTES + offset : HEADER_BYTES + offset + nbytes]
        array = np.load(out)
        assert array.dtype == np.float32 and array.tobytes() == raw, name
    # and back to a pair whose data file holds the same bytes at the same offsets
    cli.ok("pull", stem, "-o", str(tmp_path / "copy.tannic"))
    copy = load_tannic(tmp_path / "copy.tannic")
    for name, offset, nbytes in TANNIC_NN[stem]:
        assert _bits(copy.find(name)) == data[HEADER_BYTES + offset : HEADER_BYTES + offset + nbytes]


def test_push_a_pair_by_its_metadata_name(cli: Cli, tannic_nn: Path) -> None:
    cli.ok("push", str(tannic_nn / "dev-embd.metadata.tannic"), "--as", "embd")
    assert cli.json("show", "embd")["entries"][0]["shape"] == [8192]


# -- push ----------------------------------------------------------------------------------


def test_push_torch_checkpoint_with_prefix_and_replace(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    torch.save({"model": {"w": torch.ones(2, 2), "b": torch.zeros(2)}, "step": 10, "opt": [torch.full((3,), 0.5)]},
               path)
    code, out, err = cli("push", str(path), "--as", "run", "--prefix", "train")
    assert code == 0 and out == f"pushed {path} as run: 3 entries, 36 B\n"
    assert err == "warning: left out 1 value that is not a tensor (an archive holds tensors only): step (int)\n"
    assert [e["name"] for e in cli.json("show", "run")["entries"]] == ["train.model.b", "train.model.w", "train.opt.0"]

    assert "already exists" in cli.fails("push", str(path), "--as", "run")
    torch.save({"only": torch.ones(1)}, tmp_path / "v2.pt")
    cli.ok("push", str(tmp_path / "v2.pt"), "--as", "run", "--replace")
    assert [e["name"] for e in cli.json("show", "run")["entries"]] == ["only"]


def test_pushing_the_same_checkpoint_again_stores_nothing_new_and_says_so(cli: Cli, server, tmp_path: Path) -> None:
    body = tmp_path / "body.safetensors"
    safetensors.torch.save_file({"w": torch.ones(2, 3), "b": torch.zeros(3)}, body, metadata={"format": "pt"})
    first = cli.json("push", str(body), "--as", "body")
    assert first["already_stored"] is False and first["entries"] == 2
    blobs = sorted(p.name for p in (server.data_dir / "blobs").rglob("*") if p.is_file())
    assert cli.ok("push", str(body), "--as", "body") == (
        f"body is already stored with this content ({body}: 2 entries, 36 B): nothing new stored\n")
    again = cli.json("push", str(body), "--as", "body")
    assert again == {**first, "already_stored": True}
    assert sorted(p.name for p in (server.data_dir / "blobs").rglob("*") if p.is_file()) == blobs
    assert list((server.data_dir / "tmp").iterdir()) == []
    safetensors.torch.save_file({"w": torch.ones(2, 3), "b": torch.ones(3)}, body, metadata={"format": "pt"})
    assert cli.fails("push", str(body), "--as", "body") == (
        "tannery push: error: archive 'body' already exists with other content: entry 'b' differs (sha256 "
        f"{_sha(torch.zeros(3))[:16]}... there, {_sha(torch.ones(3))[:16]}... sent)\n"
        "hint: give --replace to replace it, or choose another name with --as\n")
    assert cli.json("push", str(body), "--as", "body", "--replace")["already_stored"] is False


def _sha(tensor: torch.Tensor) -> str:
    """The SHA-256 of a tensor's payload as the server stores it."""
    import hashlib

    from tannery.torch import serialize

    return hashlib.sha256(serialize(tensor)).hexdigest()


def test_push_bin_and_pt_extensions(cli: Cli, tmp_path: Path) -> None:
    for suffix in (".pt", ".bin"):
        torch.save({"w": torch.arange(4)}, tmp_path / f"m{suffix}")
        cli.ok("push", str(tmp_path / f"m{suffix}"), "--as", f"m{suffix}")
        assert cli.json("show", f"m{suffix}")["entries"][0]["dtype"] == "int64"


def test_quiet_push_prints_its_result_only(cli: Cli, tmp_path: Path) -> None:
    """-q silences progress on stderr; the result lines still print, as its help says."""
    safetensors.torch.save_file({"w": torch.ones(3)}, tmp_path / "w.safetensors")
    assert cli.ok("push", str(tmp_path / "w.safetensors"), "--as", "w", "-q") == (
        f"pushed {tmp_path / 'w.safetensors'} as w: 1 entry, 12 B\n")
    assert cli.ok("--quiet", "rm", "w").startswith("deleted w")


def test_progress_is_reported_to_the_bar(cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bar gets every payload byte pushed and pulled (drawn only on a terminal; see
    test_cli_process for the terminal itself)."""
    from contextlib import contextmanager

    from tannery.cli.output import Output

    seen: dict[str, list[int]] = {}

    @contextmanager
    def transfer(self, description: str, total: int | None):
        calls: list[int] = []
        seen[description] = calls
        yield calls.append
        calls.insert(0, total)

    monkeypatch.setattr(Output, "transfer", transfer)
    state = {"a": torch.randn(300, 1000), "b": torch.ones(7)}
    safetensors.torch.save_file(state, tmp_path / "m.safetensors")
    cli.ok("push", str(tmp_path / "m.safetensors"), "--as", "m")
    cli.ok("pull", "m", "-o", str(tmp_path / "back.safetensors"))
    payload = cli.json("show", "m")["payload_bytes"]
    for description in ("push m", "pull m"):
        total, *calls = seen[description]
        assert total == payload and sum(calls) == payload and len(calls) > 1, description


# -- pull -------------------------------------------------------------------------------------


def test_pull_names_and_prefix(cli: Cli, tmp_path: Path) -> None:
    state = {"enc.w": torch.ones(2), "enc.b": torch.zeros(1), "encoder.x": torch.ones(1), "dec.w": torch.ones(3)}
    safetensors.torch.save_file(state, tmp_path / "m.safetensors")
    cli.ok("push", str(tmp_path / "m.safetensors"), "--as", "m")

    cli.ok("pull", "m", "-o", str(tmp_path / "enc.safetensors"), "--prefix", "enc")
    assert sorted(safetensors.torch.load_file(tmp_path / "enc.safetensors")) == ["enc.b", "enc.w"]
    out = cli.ok("pull", "m", "-o", str(tmp_path / "two.tannic"), "--names", "dec.w,enc.b")
    assert "2 entries" in out and str(tmp_path / "two.metadata.tannic") in out
    assert load_tannic(tmp_path / "two.tannic").names() == ["dec.w", "enc.b"]


def test_pull_refuses_before_transferring(cli: Cli, tmp_path: Path) -> None:
    cli_path = tmp_path / "c.pt"
    torch.save({"z": torch.ones(2, dtype=torch.complex128)}, cli_path)
    cli.ok("push", str(cli_path), "--as", "c")
    assert "safetensors has no complex128" in cli.fails("pull", "c", "-o", str(tmp_path / "c.safetensors"))
    assert not (tmp_path / "c.safetensors").exists()
    cli.ok("pull", "c", "-o", str(tmp_path / "c.tannic"))  # a pair carries complex128
    assert "cannot tell the format" in cli.fails("pull", "c", "-o", str(tmp_path / "c.npz"))
    (tmp_path / "file").write_bytes(b"")
    assert "a file is in the way" in cli.fails("pull", "c", "-o", str(tmp_path / "file" / "c.tannic"))
    err = cli.fails("pull", "c", "-o", str(tmp_path / "x.tannic"), "--names", "y")
    assert err == "tannery pull: error: c: no entry 'y' in the archive\nhint: tannery show c lists its entries\n"
    assert "no entry under the prefix 'q'" in cli.fails("pull", "c", "-o", str(tmp_path / "x.tannic"), "--prefix", "q")
    assert "archive 'nope' not found" in cli.fails("pull", "nope", "-o", str(tmp_path / "x.tannic"))


# -- ls, show ----------------------------------------------------------------------------------


def test_ls_table_and_json(cli: Cli, tmp_path: Path) -> None:
    assert cli("ls") == (0, "", "no archives\n")
    assert cli.json("ls") == []
    safetensors.torch.save_file({"w": torch.ones(1024, 1536)}, tmp_path / "m.safetensors")
    for name in ("resnet-a", "resnet-b", "vit"):
        cli.ok("push", str(tmp_path / "m.safetensors"), "--as", name, "-q")
    lines = cli.ok("ls").splitlines()
    assert lines[0].split() == ["NAME", "ENTRIES", "SIZE", "CREATED"]
    assert [line.split()[:4] for line in lines[1:]] == [[n, "1", "6.0", "MiB"] for n in ("resnet-a", "resnet-b", "vit")]
    listed = cli.json("ls", "resnet")
    assert [a["name"] for a in listed] == ["resnet-a", "resnet-b"]
    assert set(listed[0]) == {"name", "entries", "nbytes", "payload_bytes", "files", "file_bytes", "created", "aliases"}
    assert listed[0]["aliases"] == []  # the aliases pointing at it (tests/test_aliases.py)
    assert listed[0]["nbytes"] == 1024 * 1536 * 4 and listed[0]["payload_bytes"] == 1024 * 1536 * 4 + 49
    assert listed[0]["created"].endswith("Z")


def test_show_table_and_json(cli: Cli, tmp_path: Path) -> None:
    state = {"w": torch.ones(512, 784), "b": torch.ones(512, dtype=torch.float16), "m": torch.ones(9, dtype=torch.bool)}
    safetensors.torch.save_file(state, tmp_path / "m.safetensors")
    cli.ok("push", str(tmp_path / "m.safetensors"), "--as", "mlp")
    lines = cli.ok("show", "mlp").splitlines()
    assert [line.split() for line in lines] == [
        ["NAME", "DTYPE", "SHAPE", "SIZE"],
        ["b", "float16", "[512]", "1.0", "KiB"],
        ["m", "bool", "[9]", "2", "B"],
        ["w", "float32", "[512,", "784]", "1.5", "MiB"],
        ["3", "entries,", "1.5", "MiB", "(1.5", "MiB", "stored", "with", "headers)"],
    ]
    shown = cli.json("show", "mlp")
    assert set(shown) == {"name", "entries", "nbytes", "payload_bytes", "metadata", "files", "values", "archive",
                          "aliases", "lost_entries"}
    assert shown["lost_entries"] == []  # nothing lost (tests/test_lost_marks.py loses some)
    assert shown["values"] == {}  # tensors alone: no plain values kept (tests/test_plain_values.py shows some)
    assert (shown["archive"], shown["aliases"]) == (shown["name"], [])  # no alias here (tests/test_aliases.py)
    assert shown["metadata"] == {}  # save_file without metadata writes no __metadata__
    assert shown["files"] == []  # a file pushed, not a folder: no files kept with it (docs/model-folders.md)
    assert shown["entries"][2] | {"digest": None} == {"name": "w", "dtype": "float32", "shape": [512, 784],
                                                      "nbytes": 512 * 784 * 4, "payload_bytes": 512 * 784 * 4 + 49,
                                                      "digest": None}
    assert len(shown["entries"][2]["digest"]) == 64
    assert shown["nbytes"] == 512 * 784 * 4 + 1024 + 2


# -- get ----------------------------------------------------------------------------------------


def test_get_prints_statistics_and_a_preview(cli: Cli, tmp_path: Path) -> None:
    values = torch.tensor([[1.0, -2.0, float("nan")], [float("inf"), 4.0, 0.5]])
    torch.save({"x": values, "i": torch.arange(10, dtype=torch.int32)}, tmp_path / "v.pt")
    cli.ok("push", str(tmp_path / "v.pt"), "--as", "v")
    lines = dict(line.split(None, 1) for line in cli.ok("get", "v", "x").splitlines()[:12])
    assert lines["dtype"] == "float32" and lines["shape"] == "[2, 3]" and lines["size"] == "24 B"
    assert (lines["min"], lines["max"], lines["nan"], lines["inf"]) == ("-2", "4", "1", "1")
    assert float(lines["mean"]) == pytest.approx(0.875)
    got = cli.json("get", "v", "i")
    assert got["stats"] == {"count": 10, "of": "values", "min": 0, "max": 9, "mean": 4.5,
                            "std": pytest.approx(np.arange(10).std()), "nan": None, "inf": None}
    assert got["preview"] == "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]"
    assert set(got) == {"archive", "entry", "dtype", "shape", "nbytes", "stats", "preview"}
    nan_json = cli.json("get", "v", "x")
    assert nan_json["stats"]["nan"] == 1 and nan_json["stats"]["min"] == -2.0


def test_get_writes_npy_and_pt(cli: Cli, tmp_path: Path) -> None:
    state = {"f": torch.randn(3, 4), "h": torch.randn(5).to(torch.bfloat16)}
    torch.save(state, tmp_path / "s.pt")
    cli.ok("push", str(tmp_path / "s.pt"), "--as", "s")
    out = cli.ok("get", "s", "f", "-o", str(tmp_path / "f.npy"))
    assert out.endswith(f"wrote {tmp_path / 'f.npy'}\n")
    assert np.array_equal(np.load(tmp_path / "f.npy"), state["f"].numpy())
    cli.ok("get", "s", "h", "-o", str(tmp_path / "h.pt"))
    assert _same(torch.load(tmp_path / "h.pt", weights_only=True), state["h"])
    assert "cannot record bfloat16\nhint: write a .pt file instead" in cli.fails("get", "s", "h", "-o", str(tmp_path / "h.npy"))
    assert "write a .npy (numpy) or .pt (torch.save) file" == cli.hint("get", "s", "h", "-o", str(tmp_path / "h.csv"))


def test_get_missing_entry_or_archive(cli: Cli, tmp_path: Path) -> None:
    torch.save({"encoder.weight": torch.ones(1)}, tmp_path / "s.pt")
    cli.ok("push", str(tmp_path / "s.pt"), "--as", "s")
    assert cli.fails("get", "s", "encoder.wieght") == (
        "tannery get: error: s: no entry 'encoder.wieght' in the archive; did you mean 'encoder.weight'?\n"
        "hint: tannery show s lists its entries\n")
    assert cli.fails("get", "nope", "w") == (
        "tannery get: error: archive 'nope' not found\nhint: tannery ls lists the archives on the server\n")


# -- union, rm -------------------------------------------------------------------------------------


def test_union_plain_and_prefixed(cli: Cli, tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    torch.save({"v": torch.zeros(3)}, tmp_path / "b.pt")
    cli.ok("push", str(tmp_path / "a.pt"), "--as", "a")
    cli.ok("push", str(tmp_path / "b.pt"), "--as", "b")
    assert cli.ok("union", "ab", "a", "b").startswith("created ab: 2 entries")
    assert [e["name"] for e in cli.json("show", "ab")["entries"]] == ["v", "w"]
    cli.ok("union", "pre", "a", "--prefix", "enc=b", "--prefix", "dec=b")
    assert [e["name"] for e in cli.json("show", "pre")["entries"]] == ["dec.v", "enc.v", "w"]
    assert "'w' is in two sources" in cli.fails("union", "clash", "a", "a")
    assert "already exists with other content: entry 'v' is missing" in cli.fails("union", "ab", "a")
    assert cli.ok("union", "ab", "b", "a") == "ab already holds this union: 2 entries, 20 B (nothing new stored)\n"
    cli.ok("union", "ab", "a", "--replace")
    assert [e["name"] for e in cli.json("show", "ab")["entries"]] == ["w"]
    assert "archive 'nope' not found" in cli.fails("union", "x", "nope")
    assert "expected PREFIX=SOURCE" in cli.fails("union", "x", "--prefix", "enc")
    assert "no sources" in cli.fails("union", "x")
    # the union shares the sources' bytes: fetching from it gives them
    cli.ok("get", "pre", "enc.v", "-o", str(tmp_path / "v.pt"))
    assert torch.equal(torch.load(tmp_path / "v.pt", weights_only=True), torch.zeros(3))


def test_rm(cli: Cli, tmp_path: Path) -> None:
    torch.save({"w": torch.ones(256)}, tmp_path / "a.pt")
    for name in ("a", "b", "c"):
        cli.ok("push", str(tmp_path / "a.pt"), "--as", name, "-q")
    assert cli.ok("rm", "a") == "deleted a (0 B freed)\n"  # b and c still share the bytes
    assert cli.ok("rm", "b", "c") == "deleted b (0 B freed)\ndeleted c (1.0 KiB freed)\n"
    assert cli.json("ls") == []
    assert cli.error("rm", "a") == "tannery rm: error: archive 'a' not found\n"


# -- failures -------------------------------------------------------------------------------------


def test_unreachable_server_names_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for argv in (["ls"], ["show", "x"], ["rm", "x"]):
        code = main(["--target", f"127.0.0.1:{port}", *argv])
        err = capsys.readouterr().err
        assert code == 1 and err.splitlines() == [
            f"tannery {argv[0]}: error: cannot reach the server at 127.0.0.1:{port} (connection refused)",
            f"hint: is a server running at 127.0.0.1:{port} (given by --target)? Start one with 'tannery serve', "
            "or give its address with --target HOST:PORT (or TANNERY_TARGET)"]


def test_target_from_the_environment(server, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANNERY_TARGET", server.target)
    assert main(["ls", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["ls", "--target", "127.0.0.1:1"]) == 1  # the flag wins
    assert "127.0.0.1:1" in capsys.readouterr().err


def test_token_and_tls_flags_reach_the_client(cli: Cli, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.server_harness import running_server

    # --token is sent as the bearer token: a server that knows only this token lets it in, and
    # refuses the same command without it or with another.
    with running_server(tmp_path / "tokens", tokens="s3cret:read") as guarded:
        with_tokens = Cli(guarded.target, capsys)
        assert with_tokens.json("ls", "--token", "s3cret") == []
        assert with_tokens.error("ls") == "tannery ls: error: this server needs a token: send 'authorization: Bearer <token>'\n"
        assert with_tokens.error("ls", "--token", "s3cre") == "tannery ls: error: the token is not one this server knows\n"
    # A server without tokens accepts any; one without TLS refuses a TLS handshake.
    assert cli.json("ls", "--token", "s3cret") == []
    err = cli.fails("ls", "--tls")
    assert err.startswith(f"tannery ls: error: cannot reach the server at {cli.target} (the TLS handshake failed)\n")
    assert err.endswith("hint: the server does not seem to use TLS: leave out --tls and the --tls-* options\n")


def test_malformed_files_are_one_line_errors(cli: Cli, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.safetensors"
    safetensors.torch.save_file({"w": torch.ones(100)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:-10])
    assert str(truncated) in cli.fails("push", str(truncated), "--as", "t")

    # a header whose shape does not match its data: [4, 4] float32 is 64 bytes, 8 are given
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 8]}}).encode()
    mismatch = tmp_path / "mismatch.safetensors"
    mismatch.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    err = cli.fails("push", str(mismatch), "--as", "t")
    assert "mismatch.safetensors" in err and "[4, 4]" in err

    from tannery.formats.checkpoint import file_header

    (tmp_path / "lonely.tannic").write_bytes(file_header(0))  # a data file without its metadata file
    assert "lonely.metadata.tannic" in cli.fails("push", str(tmp_path / "lonely.tannic"), "--as", "t")

    (tmp_path / "junk.pt").write_bytes(b"\x00" * 64)
    assert "not a checkpoint torch.load(weights_only=True) can read" in cli.fails("push", str(tmp_path / "junk.pt"),
                                                                                  "--as", "t")
    assert f"{tmp_path / 'absent.pt'}: No such file" in cli.fails("push", str(tmp_path / "absent.pt"), "--as", "t")
    assert cli.json("ls") == []  # nothing was stored


def test_entry_names_the_server_refuses(cli: Cli, tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    err = cli.fails("push", str(tmp_path / "w.pt"), "--as", "../up")
    assert err.startswith("tannery push: error: archive name '../up'")
    with pytest.raises(SystemExit) as info:  # refused as a usage error before connecting
        cli("push", str(tmp_path / "w.pt"), "--as", "")
    assert info.value.code == 2 and "--as: a name cannot be empty" in cli.capsys.readouterr().err


# -- channels -----------------------------------------------------------------------------------


def test_publish_files_in_order_to_a_client_subscriber(cli: Cli, server, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(6, dtype=np.float32).reshape(2, 3))
    torch.save(torch.ones(4, dtype=torch.bfloat16), tmp_path / "y.pt")
    torch.save({"b": torch.zeros(1), "a": torch.full((2,), 7)}, tmp_path / "ckpt.pt")
    with Client(server.target) as client, client.subscribe("acts") as subscription:
        out = cli.ok("publish", "acts", str(tmp_path / "x.npy"), str(tmp_path / "y.pt"), str(tmp_path / "ckpt.pt"))
        got = [next(subscription) for _ in range(4)]
    assert out == "published 4 tensors (52 B) on acts\n"
    assert _same(got[0], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert _same(got[1], torch.ones(4, dtype=torch.bfloat16))
    assert _same(got[2], torch.zeros(1)) and _same(got[3], torch.full((2,), 7))


def test_publish_refuses_a_bad_file_before_sending_any(cli: Cli, server, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.ones(3))
    (tmp_path / "bad.npy").write_bytes(b"nope")
    assert "bad.npy: not a .npy array" in cli.fails("publish", "c", str(tmp_path / "x.npy"), str(tmp_path / "bad.npy"))
    assert "publish it, or" not in cli.fails("publish", "c", str(tmp_path / "absent.npy"))


def test_subscribe_prints_or_writes_count_tensors(cli: Cli, server, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from tannery.cli.output import Output

    tensors = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(3, dtype=torch.bfloat16),
               torch.tensor([True, False])]
    subscribed = threading.Event()
    note = Output.note

    def noting(self: Output, text: str) -> None:
        note(self, text)
        if text.startswith("subscribed to"):  # printed once the server has registered the subscription
            subscribed.set()

    monkeypatch.setattr(Output, "note", noting)

    def publish_when_subscribed(sent: list[torch.Tensor]) -> None:
        assert subscribed.wait(30)
        subscribed.clear()
        with Client(server.target) as client:
            client.publish("ch", sent)

    thread = threading.Thread(target=publish_when_subscribed, args=(tensors,))
    thread.start()
    code, out, err = cli("subscribe", "ch", "-n", "3", "-o", str(tmp_path / "got"))
    thread.join()
    assert code == 0 and err == "subscribed to ch; waiting for 3 tensors\n"
    assert out.splitlines() == [f"000000  float32  [2, 3]  24 B  {tmp_path / 'got' / '000000.npy'}",
                                f"000001  bfloat16  [3]  6 B  {tmp_path / 'got' / '000001.pt'}",
                                f"000002  bool  [2]  2 B  {tmp_path / 'got' / '000002.npy'}"]
    assert np.array_equal(np.load(tmp_path / "got" / "000000.npy"), tensors[0].numpy())
    assert _same(torch.load(tmp_path / "got" / "000001.pt", weights_only=True), tensors[1])
    assert np.array_equal(np.load(tmp_path / "got" / "000002.npy"), [True, False])

    # Without -o: a line per tensor with its statistics; the subscription ends after -n.
    thread = threading.Thread(target=publish_when_subscribed, args=(tensors[:2] + [torch.zeros(1)],))
    thread.start()
    code, out, err = cli("subscribe", "ch", "-n", "2")
    thread.join()
    assert code == 0
    assert out.splitlines() == ["000000  float32  [2, 3]  24 B  min=0  max=5  mean=2.5",
                                "000001  bfloat16  [3]  6 B  min=1  max=1  mean=1"]
    assert "-n 0: not a count of tensors\nhint: give -n 1 or more" in cli.fails("subscribe", "ch", "-n", "0")


# -- tokens and TLS --------------------------------------------------------------------------------

WRITE_TOKEN = "cli-write-5e1d7c"
READ_TOKEN = "cli-read-9a3b2f"


def test_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.server_harness import running_server

    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    with running_server(tmp_path, tokens=f"{WRITE_TOKEN}:write,{READ_TOKEN}:read") as server:
        cli = Cli(server.target, capsys)
        assert cli.hint("ls") == "give the server's token with --token TOKEN (or set TANNERY_TOKEN)"
        cli.ok("push", str(tmp_path / "w.pt"), "--as", "w", "--token", WRITE_TOKEN)
        assert [a["name"] for a in cli.json("ls", "--token", READ_TOKEN)] == ["w"]
        err = cli.fails("rm", "w", "--token", READ_TOKEN)
        assert err.startswith("tannery rm: error: ") and "w" in cli.json("ls", "--token", READ_TOKEN)[0]["name"]
        assert cli.fails("ls", "--token", "wrong").startswith("tannery ls: error: ")
        monkeypatch.setenv("TANNERY_TOKEN", WRITE_TOKEN)
        assert cli.ok("rm", "w") == "deleted w (49 B freed)\n"


def test_tls_and_mutual_tls(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.server_harness import running_server
    from tests.test_security import Authority

    ca = Authority(tmp_path, "cli-ca")
    server_cert, server_key = ca.issue("server", server=True, names=("localhost",))
    client_cert, client_key = ca.issue("client", server=False)
    with running_server(tmp_path, tls_cert=server_cert, tls_key=server_key, tls_client_ca=ca.path) as server:
        cli = Cli(server.target, capsys)
        tls = ["--tls-ca", str(ca.path), "--tls-cert", str(client_cert), "--tls-key", str(client_key)]
        assert cli.json("ls", *tls) == []
        err = cli.fails("ls")
        assert err.startswith(f"tannery ls: error: cannot reach the server at {server.target}")
        assert err.endswith("hint: if the server uses TLS, give --tls-ca CA.pem (or --tls for a publicly trusted "
                            "certificate)\n")
        err = cli.fails("ls", "--tls-ca", str(ca.path))  # no client certificate
        assert err.endswith("hint: if the server asks for a client certificate, give --tls-cert CERT.pem and "
                            "--tls-key KEY.pem\n")
        monkeypatch.setenv("TANNERY_TLS_CA", str(ca.path))
        monkeypatch.setenv("TANNERY_CLIENT_CERT", str(client_cert))
        monkeypatch.setenv("TANNERY_CLIENT_KEY", str(client_key))
        assert cli.json("ls") == []
