"""The command line day to day, each behaviour run as a real ``tannery`` process against a real
server: commands that move no tensors import neither torch nor safetensors, pull refuses to
overwrite without --force, every output directory is created, --quiet keeps results, and
every refusal that has a remedy names it on a second line (``hint: ...``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import safetensors.torch
import torch

from .server_harness import running_server

#: Runs ``tannery ARGV`` (tannery.cli.main, as the installed script does) in a fresh process and
#: writes which of the heavy packages it imported to the file named by MODULES_FILE, at exit
#: (after --help's SystemExit too).
_RUNNER = """
import atexit, json, os, sys

def _report():
    with open(os.environ["MODULES_FILE"], "w") as f:
        json.dump(sorted(m for m in ("torch", "safetensors", "numpy", "rich") if m in sys.modules), f)

atexit.register(_report)
from tannery.cli import main
sys.argv[0] = "tannery"
sys.exit(main(sys.argv[1:]))
"""


class Run:
    """One finished ``tannery`` process: status, stdout, stderr and the heavy modules it imported."""

    def __init__(self, result: subprocess.CompletedProcess, modules: list[str]) -> None:
        self.code, self.out, self.err = result.returncode, result.stdout, result.stderr
        self.modules = modules

    @property
    def lines(self) -> list[str]:
        return self.err.splitlines()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANNERY_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def tannery(*argv: str, target: str | None = None, cwd: Path | None = None, env: dict[str, str] | None = None,
            tmp: Path) -> Run:
    """Run ``tannery argv`` (with ``--target target`` first when given) in a fresh process."""
    modules_file = tmp / f"modules-{os.getpid()}-{len(list(tmp.glob('modules-*')))}.json"
    full = (["--target", target] if target else []) + list(argv)
    result = subprocess.run([sys.executable, "-c", _RUNNER, *full], capture_output=True, text=True, timeout=120,
                            cwd=cwd, env={**(env or _env()), "MODULES_FILE": str(modules_file)})
    modules = json.loads(modules_file.read_text()) if modules_file.exists() else []
    return Run(result, modules)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with running_server(tmp_path_factory.mktemp("server")) as running:
        yield running


@pytest.fixture
def model(server, tmp_path: Path) -> str:
    """An archive of two float32 entries on the server (a new name per test)."""
    name = f"model-{tmp_path.name}"
    safetensors.torch.save_file({"2.bias": torch.arange(4.0), "2.weight": torch.ones(4, 2)}, tmp_path / "m.safetensors")
    run = tannery("push", str(tmp_path / "m.safetensors"), "--as", name, target=server.target, tmp=tmp_path)
    assert run.code == 0, run.err
    return name


# -- what a command imports ----------------------------------------------------------------------


#: Commands that only talk to the catalog: no torch, no safetensors, and no numpy or rich either.
CATALOG_COMMANDS = [["ls"], ["ls", "--json"], ["show", "{m}"], ["show", "{m}", "--json"], ["union", "{m}-u", "{m}"],
                    ["rm", "{m}-u"], ["diff", "{m}", "{m}"], ["diff", "{m}", "{m}", "--json"]]


@pytest.mark.parametrize("argv", CATALOG_COMMANDS, ids=" ".join)
def test_catalog_commands_import_no_torch_numpy_or_rich(server, model: str, tmp_path: Path, argv: list[str]) -> None:
    if argv[0] == "rm":
        assert tannery("union", f"{model}-u", model, target=server.target, tmp=tmp_path).code == 0
    run = tannery(*[a.format(m=model) for a in argv], target=server.target, tmp=tmp_path)
    assert run.code == 0, run.err
    assert run.modules == [], f"tannery {' '.join(argv)} imported {run.modules}"


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["ls", "--help"], ["pull", "--help"]], ids=" ".join)
def test_help_imports_no_torch(argv: list[str], tmp_path: Path) -> None:
    run = tannery(*argv, tmp=tmp_path)
    assert run.code == 0 and run.out.startswith("usage: tannery"), run.err
    assert "torch" not in run.modules and "safetensors" not in run.modules


def test_tensor_commands_import_torch_only_where_a_tensor_is_made(server, model: str, tmp_path: Path) -> None:
    """pull writes bytes (no tensor is made); get, push and pull refusals stop before any.
    (A push that reaches the server builds its first tensor as it starts sending.)"""
    no_torch = [
        ("pull", model, "-o", str(tmp_path / "out.safetensors")),   # a whole pull
        ("pull", model, "-o", str(tmp_path / "out.safetensors")),   # refused: the file exists
        ("get", model, "2.bais"),                                   # no such entry
        ("get", "absent", "w"),                                     # no such archive
        ("push", str(tmp_path / "absent.safetensors"), "--as", "x"),
        ("push", str(tmp_path / "m.onnx"), "--as", "x"),            # no such file (whatever the extension)
    ]
    for argv in no_torch:
        run = tannery(*argv, target=server.target, tmp=tmp_path)
        assert run.code == (0 if argv is no_torch[0] else 1), (argv, run.err)
        assert "torch" not in run.modules and "safetensors" not in run.modules, (argv, run.modules)
    # ... and the check sees an import when there is one: get makes a torch tensor.
    run = tannery("get", model, "2.bias", target=server.target, tmp=tmp_path)
    assert run.code == 0 and "torch" in run.modules


def test_import_tannery_keeps_its_names_without_importing_torch() -> None:
    code = ("import sys, tannery; names = [tannery.Client, tannery.Archive, tannery.NotFound, tannery.aio.Client, "
            "tannery.RemoteArchive, tannery.load_safetensors]; print('torch' in sys.modules, 'safetensors' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env())
    assert (result.returncode, result.stdout) == (0, "False False\n"), result.stderr


# -- pull, outputs and --quiet ----------------------------------------------------------------------


def test_pull_refuses_to_overwrite_without_force(server, model: str, tmp_path: Path) -> None:
    out = tmp_path / "mine.safetensors"
    out.write_bytes(b"my own file")
    run = tannery("pull", model, "-o", str(out), target=server.target, tmp=tmp_path)
    assert (run.code, run.out) == (1, "")
    assert run.lines == [f"tannery pull: error: {out}: the file exists; nothing was written",
                         "hint: give --force to replace it, or write elsewhere with -o"]
    assert out.read_bytes() == b"my own file"
    run = tannery("pull", model, "-o", str(out), "--force", target=server.target, tmp=tmp_path)
    assert run.code == 0, run.err
    assert safetensors.torch.load_file(out)["2.bias"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_pull_of_a_pair_refuses_if_either_file_exists(server, model: str, tmp_path: Path) -> None:
    (tmp_path / "pair.metadata.tannic").write_bytes(b"x")
    run = tannery("pull", model, "-o", str(tmp_path / "pair.tannic"), target=server.target, tmp=tmp_path)
    assert run.code == 1 and "pair.metadata.tannic: the file exists" in run.lines[0] and "--force" in run.lines[1]
    assert not (tmp_path / "pair.tannic").exists()


def test_get_refuses_to_overwrite_without_force(server, model: str, tmp_path: Path) -> None:
    (tmp_path / "b.npy").write_bytes(b"mine")
    run = tannery("get", model, "2.bias", "-o", str(tmp_path / "b.npy"), target=server.target, tmp=tmp_path)
    assert run.code == 1 and run.lines[1] == "hint: give --force to replace it, or write elsewhere with -o"
    run = tannery("get", model, "2.bias", "-o", str(tmp_path / "b.npy"), "-f", target=server.target, tmp=tmp_path)
    assert run.code == 0 and np.load(tmp_path / "b.npy").tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.slow
def test_every_command_creates_its_output_directories(server, model: str, tmp_path: Path) -> None:
    run = tannery("pull", model, "-o", str(tmp_path / "out" / "deep" / "x.tannic"), target=server.target, tmp=tmp_path)
    assert run.code == 0, run.err
    assert (tmp_path / "out" / "deep" / "x.tannic").is_file() and (tmp_path / "out" / "deep" / "x.metadata.tannic").is_file()
    run = tannery("get", model, "2.bias", "-o", str(tmp_path / "one" / "two" / "b.npy"), target=server.target, tmp=tmp_path)
    assert run.code == 0 and (tmp_path / "one" / "two" / "b.npy").is_file(), run.err
    np.save(tmp_path / "t.npy", np.arange(3, dtype=np.int32))
    env = {**_env(), "MODULES_FILE": str(tmp_path / "sub.json")}
    subscriber = subprocess.Popen([sys.executable, "-c", _RUNNER, "--target", server.target, "subscribe", "dirs", "-n", "1",
                                   "-o", str(tmp_path / "got" / "here")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
    try:
        assert subscriber.stderr.readline().startswith("subscribed to dirs")
        assert tannery("publish", "dirs", str(tmp_path / "t.npy"), target=server.target, tmp=tmp_path).code == 0
        out, err = subscriber.communicate(timeout=60)
    finally:
        subscriber.kill()
    assert subscriber.returncode == 0, err
    assert np.load(tmp_path / "got" / "here" / "000000.npy").tolist() == [0, 1, 2]


def test_a_file_in_the_way_of_an_output_directory_is_named(server, model: str, tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_bytes(b"")
    for argv, directory in ((["pull", model, "-o", str(file / "x.safetensors")], file),
                            (["get", model, "2.bias", "-o", str(file / "b.npy")], file),
                            (["subscribe", "c", "-o", str(file / "dir")], file / "dir")):
        run = tannery(*argv, target=server.target, tmp=tmp_path)
        assert run.code == 1 and run.lines == [
            f"tannery {argv[0]}: error: cannot make the directory {directory}: a file is in the way",
            "hint: give -o a path in a directory, or move that file"], run.err


def test_subscribe_refuses_to_overwrite_earlier_tensors_without_force(server, tmp_path: Path) -> None:
    (tmp_path / "got").mkdir()
    (tmp_path / "got" / "000000.npy").write_bytes(b"earlier")
    run = tannery("subscribe", "c", "-n", "1", "-o", str(tmp_path / "got"), target=server.target, tmp=tmp_path)
    assert run.code == 1 and "holds 1 received tensor file(s) (000000.npy)" in run.lines[0]
    assert run.lines[1] == "hint: give --force to overwrite them, or another directory with -o"


def test_quiet_push_still_prints_its_result(server, tmp_path: Path) -> None:
    safetensors.torch.save_file({"w": torch.ones(3)}, tmp_path / "w.safetensors")
    run = tannery("push", str(tmp_path / "w.safetensors"), "--as", f"quiet-{tmp_path.name}", "-q", target=server.target,
                  tmp=tmp_path)
    assert (run.code, run.err) == (0, "")
    assert run.out == f"pushed {tmp_path / 'w.safetensors'} as quiet-{tmp_path.name}: 1 entry, 12 B\n"


# -- refusals name their remedy ----------------------------------------------------------------------


@pytest.mark.slow
def test_a_refused_push_names_replace(server, model: str, tmp_path: Path) -> None:
    run = tannery("push", str(tmp_path / "m.safetensors"), "--as", model, target=server.target, tmp=tmp_path)
    assert (run.code, run.out) == (0, f"{model} is already stored with this content ({tmp_path / 'm.safetensors'}: "
                                      "2 entries, 48 B): nothing new stored\n"), run.err
    safetensors.torch.save_file({"2.bias": torch.arange(4.0), "2.weight": torch.zeros(4, 2)}, tmp_path / "m2.safetensors")
    run = tannery("push", str(tmp_path / "m2.safetensors"), "--as", model, target=server.target, tmp=tmp_path)
    assert run.code == 1 and len(run.lines) == 2, run.err
    assert run.lines[0].startswith(f"tannery push: error: archive '{model}' already exists with other content: "
                                   "entry '2.weight' differs (sha256 "), run.lines
    assert run.lines[1] == "hint: give --replace to replace it, or choose another name with --as"
    run = tannery("push", str(tmp_path / "m2.safetensors"), "--as", model, "--replace", target=server.target,
                  tmp=tmp_path)
    assert run.code == 0, run.err
    run = tannery("union", model, model, "--prefix", f"x={model}", target=server.target, tmp=tmp_path)
    assert run.code == 1 and run.lines[1] == "hint: give --replace to replace it, or choose another TARGET"


def test_a_refused_store_in_python_names_replace_true(server, model: str) -> None:
    code = (f"import tannery, torch\nwith tannery.Client({server.target!r}) as c:\n"
            f"    try: c.store({model!r}, {{'w': torch.ones(1)}})\n"
            "    except tannery.AlreadyExists as e: print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env())
    assert result.stdout == (f"archive '{model}' already exists with other content: entry 'w' sent is not there "
                             "(it has 2 entries) (give replace=True to replace it)\n"), result.stderr


def test_push_of_a_missing_file_says_no_such_file(server, tmp_path: Path) -> None:
    for name in ("nope", "nope.safetensors", "nope.tannic", "nope.pt"):
        run = tannery("push", name, "--as", "x", target=server.target, cwd=tmp_path, tmp=tmp_path)
        assert (run.code, run.lines) == (1, [f"tannery push: error: {name}: No such file"]), run.err


def test_an_unreachable_server_says_where_it_looked_and_what_to_do(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{s.getsockname()[1]}"
    run = tannery("ls", tmp=tmp_path, env=_env(TANNERY_TARGET=target, TANNERY_RETRIES="0"))
    assert (run.code, run.out) == (1, "")
    assert run.lines == [f"tannery ls: error: cannot reach the server at {target} (connection refused)",
                         f"hint: is a server running at {target} (from TANNERY_TARGET)? Start one with 'tannery serve', "
                         "or give its address with --target HOST:PORT (or TANNERY_TARGET)"]


def test_a_missing_archive_or_entry_names_where_to_look(server, model: str, tmp_path: Path) -> None:
    run = tannery("show", "absent", target=server.target, tmp=tmp_path)
    assert run.lines == ["tannery show: error: archive 'absent' not found",
                         "hint: tannery ls lists the archives on the server"]
    run = tannery("get", model, "2.bais", target=server.target, tmp=tmp_path)
    assert run.lines == [f"tannery get: error: {model}: no entry '2.bais' in the archive; did you mean '2.bias'?",
                         f"hint: tannery show {model} lists its entries"]


def test_archive_tensor_of_a_missing_entry_suggests_close_names(server, model: str) -> None:
    """In Python as on the command line: a local archive, and a remote one."""
    code = (f"import tannery, torch\n"
            "a = tannery.Archive.of_list({'2.bias': torch.zeros(4), '2.weight': torch.zeros(4, 2)})\n"
            f"with tannery.Client({server.target!r}) as c:\n"
            f"    for archive in (a, c.archive({model!r})):\n"
            "        try: archive.tensor('2.bais', [4], torch.float32)\n"
            "        except tannery.ArchiveError as e: print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env())
    assert result.stdout.splitlines() == ["Archive.tensor: 2.bais: no entry in the archive; did you mean '2.bias'?"] * 2, \
        result.stderr
