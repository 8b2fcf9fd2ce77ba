"""The command line's parts that need no server: files it reads and writes, statistics,
formatting, argument parsing, and error lines."""

from __future__ import annotations

import io
import json
import pickle
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch

from tannery.cli import build_parser, main
from tannery.cli.archives import union_sources
from tannery.cli.connection import tls_options
from tannery.cli.errors import CommandError, error_message
from tannery.cli.output import Output, human_size, iso_time, local_time
from tannery.cli.stats import preview, statistics
from tannery.cli.tensorfiles import (
    check_writable,
    payload_total,
    read_checkpoint,
    read_tensors,
    save_tensor,
    to_numpy,
)
from tannery_protocol.errors import NotFound, Unavailable
from tannery.torch import serialize


def _state() -> dict[str, torch.Tensor]:
    return {
        "encoder.weight": torch.randn(4, 3),
        "encoder.bias": torch.arange(4, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(2, 2, dtype=torch.bfloat16),
    }


# -- checkpoint files --------------------------------------------------------------------------


def test_read_checkpoint_safetensors_is_mapped_and_exact(tmp_path: Path) -> None:
    state = _state()
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(state, path)
    archive = read_checkpoint(path)
    assert archive.names() == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(archive.find(name), tensor)


def test_read_checkpoint_torch_structure_names_leaves_by_path(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.ones(2)}, "optim": [torch.zeros(3)], "step": 7}, path)
    archive = read_checkpoint(path)
    assert archive.names() == ["model.w", "optim.0"]
    assert torch.equal(archive.find("optim.0"), torch.zeros(3))


def test_read_checkpoint_tannic_pair_by_either_name(tmp_path: Path) -> None:
    from tannery.torch import write

    write({"a": torch.arange(6, dtype=torch.float32)}, tmp_path / "pair")
    for name in ("pair.tannic", "pair.metadata.tannic"):
        archive = read_checkpoint(tmp_path / name)
        assert torch.equal(archive.find("a"), torch.arange(6, dtype=torch.float32))


def test_read_checkpoint_refuses_unknown_extension(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"onnx")
    with pytest.raises(CommandError, match=r"model\.onnx: cannot tell the format"):
        read_checkpoint(tmp_path / "model.onnx")
    with pytest.raises(FileNotFoundError):  # absent: "no such file", whatever the extension
        read_checkpoint(tmp_path / "absent")


def test_read_checkpoint_refuses_pickled_objects(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(1), "obj": Path("x")}, path)
    with pytest.raises(CommandError, match=r"evil\.pt: not a checkpoint torch\.load\(weights_only=True\) can read"):
        read_checkpoint(path)


def test_read_checkpoint_refuses_garbage_and_single_tensors(tmp_path: Path) -> None:
    garbage = tmp_path / "junk.pth"
    garbage.write_bytes(b"not a zip file at all")
    with pytest.raises(CommandError, match="junk.pth: not a checkpoint"):
        read_checkpoint(garbage)
    single = tmp_path / "one.pt"
    torch.save(torch.ones(3), single)
    with pytest.raises(CommandError, match="one tensor, not a checkpoint"):
        read_checkpoint(single)
    empty = tmp_path / "empty.pt"
    torch.save({"step": 3}, empty)
    with pytest.raises(CommandError, match="no tensors in the checkpoint"):
        read_checkpoint(empty)


def test_read_checkpoint_missing_file_is_os_error(tmp_path: Path) -> None:
    with pytest.raises(OSError) as info:
        read_checkpoint(tmp_path / "absent.pt")
    assert error_message(info.value) == f"{tmp_path / 'absent.pt'}: No such file"
    with pytest.raises(OSError):
        read_checkpoint(tmp_path / "absent.safetensors")


def test_payload_total_counts_headers_and_packed_bools() -> None:
    from tannery import Archive

    state = _state()
    archive = Archive.of_list(state)
    assert payload_total(archive) == sum(len(serialize(t)) for t in state.values())


def test_check_writable(tmp_path: Path) -> None:
    check_writable(tmp_path / "a.safetensors", ["float32"])
    check_writable(tmp_path / "a.tannic", ["complex128"])
    with pytest.raises(CommandError, match="safetensors has no complex128"):
        check_writable(tmp_path / "a.safetensors", ["complex128", "float32"])
    assert check_writable(tmp_path / "a.pt", ["complex128", "bfloat16"]) == [tmp_path / "a.pt"]  # torch has them all
    with pytest.raises(CommandError, match="cannot tell the format"):
        check_writable(tmp_path / "a.csv", ["float32"])
    assert check_writable(tmp_path / "missing" / "a.safetensors", ["float32"]) == [tmp_path / "missing" / "a.safetensors"]
    assert (tmp_path / "missing").is_dir()  # made, as every command makes its output directories
    assert check_writable(tmp_path / "p.tannic", ["int8"]) == [tmp_path / "p.tannic", tmp_path / "p.metadata.tannic"]
    (tmp_path / "p.metadata.tannic").write_bytes(b"")
    with pytest.raises(CommandError, match="p.metadata.tannic: the file exists") as info:
        check_writable(tmp_path / "p.tannic", ["int8"])
    assert "--force" in (info.value.hint or "")
    check_writable(tmp_path / "p.tannic", ["int8"], force=True)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(CommandError, match="a file is in the way"):
        check_writable(tmp_path / "file" / "a.safetensors", ["float32"])


# -- single tensors ------------------------------------------------------------------------------


def test_read_tensors_in_order(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(5, dtype=np.int16))
    torch.save(torch.ones(2, 2), tmp_path / "y.pt")
    torch.save({"b": torch.zeros(1), "a": [torch.ones(1), torch.full((1,), 2.0)]}, tmp_path / "z.pt")
    got = [(name, t) for path in ("x.npy", "y.pt", "z.pt") for name, t in read_tensors(tmp_path / path)]
    assert [name for name, _ in got] == ["x", "y", "b", "a.0", "a.1"]
    assert torch.equal(got[0][1], torch.arange(5, dtype=torch.int16))
    assert torch.equal(got[4][1], torch.full((1,), 2.0))


def test_read_tensors_refuses_bad_files(tmp_path: Path) -> None:
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(CommandError, match="bad.npy: not a .npy array"):
        list(read_tensors(tmp_path / "bad.npy"))
    np.save(tmp_path / "strings.npy", np.array(["a", "b"]))
    with pytest.raises(CommandError, match="strings.npy: numpy dtype <U1 has no tannic dcode"):
        list(read_tensors(tmp_path / "strings.npy"))
    (tmp_path / "x.csv").write_text("1,2")
    with pytest.raises(CommandError, match="x.csv: cannot tell the format") as info:
        list(read_tensors(tmp_path / "x.csv"))
    assert (info.value.hint or "").startswith("give a .npy or .pt tensor")
    with pytest.raises(FileNotFoundError):
        list(read_tensors(tmp_path / "absent.csv"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.bool, torch.complex64,
                                   torch.uint16])
def test_to_numpy_keeps_the_bits(dtype: torch.dtype) -> None:
    tensor = (torch.randn(3, 4) * 10).to(dtype)
    array = to_numpy(tensor)
    assert array.shape == (3, 4)
    assert array.tobytes() == tensor.contiguous().view(torch.uint8).numpy().tobytes()


def test_save_tensor_npy_and_pt(tmp_path: Path) -> None:
    tensor = torch.randn(3, 5)[:, ::2]  # not contiguous
    save_tensor(tmp_path / "t.npy", tensor)
    assert np.array_equal(np.load(tmp_path / "t.npy"), tensor.numpy())
    half = torch.randn(4, dtype=torch.bfloat16)
    save_tensor(tmp_path / "h.pt", half)
    assert torch.equal(torch.load(tmp_path / "h.pt", weights_only=True), half)
    with pytest.raises(CommandError, match="a .npy file cannot record bfloat16") as info:
        save_tensor(tmp_path / "h.npy", half)
    assert info.value.hint == "write a .pt file instead"
    assert not (tmp_path / "h.npy").exists()
    with pytest.raises(CommandError, match="t.txt: cannot tell the format") as info:
        save_tensor(tmp_path / "t.txt", tensor)
    assert info.value.hint == "write a .npy (numpy) or .pt (torch.save) file"


# -- statistics and preview ------------------------------------------------------------------------


def test_statistics_of_floats_skip_nan_and_inf() -> None:
    values = np.array([1.0, 2.0, np.nan, np.inf, -np.inf, -3.0], dtype=np.float32)
    stats = statistics(values)
    finite = np.array([1.0, 2.0, -3.0])
    assert (stats.count, stats.nan, stats.inf) == (6, 1, 2)
    assert (stats.min, stats.max) == (-3.0, 2.0)
    assert stats.mean == pytest.approx(finite.mean()) and stats.std == pytest.approx(finite.std())


def test_statistics_merge_chunks_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    import tannery.cli.stats as stats_module

    monkeypatch.setattr(stats_module, "CHUNK", 7)
    values = np.random.default_rng(0).normal(5, 3, size=1000)
    stats = statistics(values)
    assert stats.mean == pytest.approx(values.mean(), rel=1e-12)
    assert stats.std == pytest.approx(values.std(), rel=1e-12)
    assert (stats.min, stats.max) == (values.min(), values.max())


def test_statistics_of_ints_bools_complex_and_empty() -> None:
    big = np.array([2**63 - 1, 0], dtype=np.int64)
    assert statistics(big).max == 2**63 - 1 and statistics(big).nan is None
    assert statistics(np.array([True, False, True, True])).mean == 0.75
    cplx = statistics(np.array([3 + 4j, -6 + 8j], dtype=np.complex64))
    assert (cplx.of, cplx.min, cplx.max) == ("abs", 5.0, 10.0)
    empty = statistics(np.zeros((0, 3), dtype=np.float32))
    assert (empty.count, empty.min, empty.mean, empty.std) == (0, None, None, None)
    half = statistics(np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16))
    assert (half.min, half.max, half.nan) == (-2.0, 1.5, 0)
    json.dumps(half.as_dict(), allow_nan=False)


def test_preview_is_short() -> None:
    text = preview(np.zeros((64, 3, 3, 3), dtype=np.float32))
    assert len(text.splitlines()) <= 17 and "..." in text
    assert preview(np.arange(4)) == "[0, 1, 2, 3]"
    assert "..." in preview(np.arange(1000))


# -- formatting ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536 * 1024, "1.5 MiB"),
                                          (5 * 2**30, "5.0 GiB")])
def test_human_size(nbytes: int, text: str) -> None:
    assert human_size(nbytes) == text


def test_times() -> None:
    import datetime as dt

    when = dt.datetime(2025, 1, 31, 12, 0, 5, 123000, tzinfo=dt.timezone.utc)
    assert iso_time(when) == "2025-01-31T12:00:05Z"
    assert iso_time(None) is None and local_time(None) == "-"
    assert local_time(when).startswith("2025-01-3")


def test_table_off_a_terminal_keeps_rows_whole() -> None:
    stdout = io.StringIO()
    long_name = "encoder.layers.0.self_attention.query_key_value.weight" * 3
    Output(stdout=stdout).table([("NAME", "left"), ("SIZE", "right")], [(long_name, "1.0 KiB")], footer="1 entry")
    lines = stdout.getvalue().splitlines()
    assert lines[0].split() == ["NAME", "SIZE"]
    assert lines[1].split() == [long_name, "1.0", "KiB"]
    assert lines[2] == "1 entry"
    assert "\x1b" not in stdout.getvalue()


def test_transfer_is_silent_off_a_terminal() -> None:
    stderr = io.StringIO()
    with Output(stderr=stderr).transfer("push", 100) as progress:
        progress(50)
        progress(50)
    assert stderr.getvalue() == ""


def test_results_print_with_quiet() -> None:
    """--quiet silences progress notes on stderr, never results on stdout."""
    stdout, stderr = io.StringIO(), io.StringIO()
    quiet = Output(quiet=True, stdout=stdout, stderr=stderr)
    quiet.result("pushed")
    quiet.note("subscribed")
    quiet.line("result")
    assert (stdout.getvalue(), stderr.getvalue()) == ("pushed\nresult\n", "")


# -- arguments and errors ----------------------------------------------------------------------------


def test_global_options_before_or_after_the_subcommand() -> None:
    parser = build_parser()
    before = parser.parse_args(["--target", "h:1", "--token", "t", "ls"])
    after = parser.parse_args(["ls", "--target", "h:1", "--token", "t"])
    for args in (before, after):
        assert (args.target, args.token, args.command) == ("h:1", "t", "ls")
    assert parser.parse_args(["-q", "show", "x"]).quiet is True
    assert parser.parse_args(["show", "x"]).target is None


def test_tls_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("TANNERY_TLS", "TANNERY_TLS_CA", "TANNERY_CLIENT_CERT", "TANNERY_CLIENT_KEY"):
        monkeypatch.delenv(name, raising=False)
    parser = build_parser()
    assert tls_options(parser.parse_args(["ls"])) is None
    assert tls_options(parser.parse_args(["ls", "--tls"])) == {"ca": None, "cert": None, "key": None}
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    assert tls_options(parser.parse_args(["ls", "--tls-ca", str(ca)]))["ca"] == str(ca)
    monkeypatch.setenv("TANNERY_TLS", "1")
    assert tls_options(parser.parse_args(["ls"])) is not None
    monkeypatch.setenv("TANNERY_TLS", "maybe")
    with pytest.raises(CommandError, match="TANNERY_TLS='maybe'"):
        tls_options(parser.parse_args(["ls"]))
    monkeypatch.delenv("TANNERY_TLS")
    with pytest.raises(CommandError, match="--tls-cert without --tls-key") as info:
        tls_options(parser.parse_args(["ls", "--tls-cert", str(ca)]))
    assert "give both" in (info.value.hint or "")
    with pytest.raises(CommandError, match="--tls-ca .*absent.pem: no such file"):
        tls_options(parser.parse_args(["ls", "--tls-ca", str(tmp_path / "absent.pem")]))


def test_union_sources() -> None:
    assert union_sources(["a", "b"], []) == ["a", "b"]
    assert union_sources(["a"], ["enc=b", "dec=c"]) == {"": "a", "enc": "b", "dec": "c"}
    assert union_sources([], ["enc=b", "dec=b"]) == {"enc": "b", "dec": "b"}
    with pytest.raises(CommandError, match="expected PREFIX=SOURCE"):
        union_sources([], ["enc"])
    with pytest.raises(CommandError, match="--prefix enc: given twice"):
        union_sources([], ["enc=a", "enc=b"])
    with pytest.raises(CommandError, match="at most one source may go without a prefix"):
        union_sources(["a", "b"], ["enc=c"])
    with pytest.raises(CommandError, match="no sources"):
        union_sources([], [])


def test_error_messages_are_one_line() -> None:
    assert error_message(NotFound("archive 'x' not found")) == "archive 'x' not found"
    assert error_message(KeyError("entry")) == "entry"
    assert error_message(ValueError("line one\n  line two")) == "line one line two"
    gone = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote " \
           "host: Connection refused (server h:1)"
    assert error_message(Unavailable(gone), "h:1") == "cannot reach the server at h:1 (connection refused)"
    assert error_message(Unavailable("storage unavailable: disk I/O error (server h:1)"), "h:1") == (
        "the server at h:1 is unavailable: storage unavailable: disk I/O error")


@pytest.mark.parametrize("argv", [[], ["push", "x.pt"], ["pull", "x"], ["frobnicate"], ["pull", "a", "-o", "f",
                                                                                      "--prefix", "p", "--names", "n"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage: tannery" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["push", "pull", "ls", "show", "get", "union", "rm", "publish", "subscribe"])
def test_every_subcommand_explains_itself(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: tannery {command}" in text and "examples:\n  tannery " + command in text
    assert "--target" in text


def test_json_keys_are_documented(capsys: pytest.CaptureFixture[str]) -> None:
    for command, keys in (("ls", ["name", "entries", "nbytes", "payload_bytes", "created"]),
                          ("show", ["digest", "payload_bytes"]), ("get", ["stats", "preview", "nan", "inf"])):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert all(key in text for key in keys), command


def test_main_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for command in ("serve", "push", "pull", "ls", "show", "get", "union", "rm", "publish", "subscribe"):
        assert f"    {command} " in text
    assert "examples:" in text and "exit status" in text


def test_a_bad_file_is_one_line_and_status_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 1000) + b"{}")
    assert main(["push", str(bad), "--as", "x", "--target", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tannery push: error: ") and str(bad) in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_pickle_bomb_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # weights_only refuses a pickle that calls a function; nothing runs.
    class Boom:
        def __reduce__(self):
            return (print, ("ran!",))

    path = tmp_path / "boom.pt"
    with open(path, "wb") as f:
        pickle.dump(Boom(), f)
    assert main(["push", str(path), "--as", "x", "--target", "127.0.0.1:1"]) == 1
    out = capsys.readouterr()
    assert "ran!" not in out.out and "not a checkpoint torch.load(weights_only=True) can read" in out.err


def test_json_keeps_shapes_on_one_line_and_strings_intact() -> None:
    from tannery.cli.output import compact_json

    value = {"shape": [10, 64], "empty": [], "stats": {"min": -1.5e-3}, "preview": "[\n 0.1, ..., 2 ]",
             "entries": [{"shape": [3]}], "names": ["a", "b"]}
    text = compact_json(value)
    assert json.loads(text) == value
    assert '"shape": [10, 64]' in text and '"shape": [3]' in text and '"names": [\n' in text
