"""Issue 42: the data directory is private, and the same-host socket is its user's only.

A throwaway local user (``useradd``, removed after) can read no file of the data directory and
cannot connect to the socket; a client run as that user takes the data port instead (its
"auto" transport falls back on EACCES). Modes are set explicitly, whatever the umask.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import tannery
from tannery_server.config import Config
from tannery_server.storage.private import check_private, exposed, socket_directory

from .server_harness import running_server


def modes_under(root: Path) -> dict[str, int]:
    """Every path under ``root`` (itself included, symlinks skipped) and its permission bits."""
    found = {str(root): stat.S_IMODE(root.lstat().st_mode)}
    for parent, directories, files in os.walk(root):
        for name in directories + files:
            path = Path(parent) / name
            if not path.is_symlink():
                found[str(path)] = stat.S_IMODE(path.lstat().st_mode)
    return found


def test_a_server_under_umask_000_makes_its_directories_0700_and_its_files_0600(tmp_path):
    """A server process with umask 000 stores an archive: every directory it made is 0700, every
    file (blobs, catalog, its WAL, lock, reserve, socket) 0600, while it runs."""
    data = tmp_path / "data"
    script = textwrap.dedent(f"""
        import json, os, sys
        os.umask(0)
        from pathlib import Path
        from tests.server_harness import running_server
        from tests.test_private_data import modes_under
        import numpy as np, tannery
        with running_server(Path({str(tmp_path)!r})) as server:
            with tannery.Client(server.target, transport="grpc") as client:
                client.store("w", {{"a": np.arange(1 << 16, dtype=np.float32), "b": np.ones(3)}})
            print(json.dumps(modes_under(Path({str(data)!r}))))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    modes = json.loads(done.stdout.strip().splitlines()[-1])
    assert any(p.endswith("-wal") for p in modes) and any("/blobs/" in p for p in modes), modes
    loose = {p: oct(m) for p, m in modes.items() if m & 0o077}
    assert not loose, f"readable by others under umask 000: {loose}"
    assert all(m in (0o700, 0o600) for m in modes.values()), {p: oct(m) for p, m in modes.items()}


def test_an_exposed_data_directory_is_named_with_its_fix_and_fixed_on_request(tmp_path, caplog):
    """A data directory left 0755 with a 0644 file is named at start, with the chmod that fixes
    it; with fix_permissions the group and others lose every access."""
    data = tmp_path / "data"
    (data / "blobs" / "ab").mkdir(parents=True)
    (data / "blobs" / "ab" / "x").write_bytes(b"1")
    for path, mode in ((data, 0o755), (data / "blobs", 0o755), (data / "blobs" / "ab", 0o755),
                       (data / "blobs" / "ab" / "x", 0o644)):
        path.chmod(mode)
    with caplog.at_level(logging.WARNING, "tannery_server.storage"):
        assert set(check_private(data, fix_permissions=False)) == {data, data / "blobs", data / "blobs" / "ab"}
    assert f"chmod -R go-rwx {data.resolve()}" in caplog.text and "--fix-permissions" in caplog.text
    assert str(data / "blobs" / "ab") in caplog.text
    check_private(data, fix_permissions=True)
    assert exposed(data) == [] and not any(m & 0o077 for m in modes_under(data).values())


def test_the_socket_is_0600_by_default_and_socket_mode_opens_it_to_a_group(tmp_path):
    """The default socket is 0600 in the 0700 data directory; --socket-mode 0660 with the socket
    in a new directory outside it gives 0660, in a directory the group may search (0710)."""
    with running_server(tmp_path) as server:
        path = server.data_paths.socket_path
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    elsewhere = tmp_path / "run" / "tannery.sock"
    with running_server(tmp_path, data_dir=tmp_path / "data2", socket=str(elsewhere), socket_mode="0660"):
        assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o660
        assert stat.S_IMODE(elsewhere.parent.stat().st_mode) == 0o710


def test_a_socket_mode_its_directory_defeats_is_warned_about(tmp_path, caplog):
    """An existing 0700 directory with a socket mode for others: the warning says where to put it."""
    directory = tmp_path / "closed"
    directory.mkdir(mode=0o700)
    with caplog.at_level(logging.WARNING, "tannery_server.storage"):
        socket_directory(directory, 0o666)
    assert "keeps them out" in caplog.text and "--socket /run/tannery/tannery.sock" in caplog.text


@pytest.mark.parametrize("mode", ["rw", "0400", "0800", "1777x"])
def test_a_bad_socket_mode_is_refused_naming_the_accepted_forms(mode):
    with pytest.raises(ValueError, match="socket_mode"):
        Config(socket_mode=mode)


@pytest.fixture
def other_user() -> Iterator[pwd.struct_passwd]:
    """A local user made for this test (no home, no shell), removed after."""
    if os.geteuid() != 0:
        pytest.skip("making a second local user (useradd) needs root; run as root to check what another user sees")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed: no second local user to check what another user sees")
    name = f"tny{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False)


#: Run as the other user: modules are imported first (as root: this interpreter lives under
#: /root), then the process becomes that user and tries the files, the socket, and a client.
_AS_OTHER_USER = """
import json, os, socket, sys
import numpy as np, tannery
import encodings.idna, tannery.dataplane.transports, tannery.dataplane.links  # before the privileges go
uid, gid, paths, sock, target = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
with tannery.Client(target, transport="tcp") as warm:
    warm.fetch("w").find("a").numpy()  # every module a fetch needs, loaded while they can be read
os.setgroups([]); os.setgid(gid); os.setuid(uid)
readable = []
for path in paths:
    try:
        os.listdir(path) if os.path.isdir(path) else open(path, "rb").close()
        readable.append(path)
    except PermissionError:
        pass
try:
    socket.socket(socket.AF_UNIX).connect(sock)
    connected = "yes"
except OSError as exc:
    connected = type(exc).__name__
with tannery.Client(target, transport="auto") as client:
    transport = client.transport
    same = np.array_equal(client.fetch("w").find("a").numpy(), np.arange(1 << 16, dtype=np.float32))
why = ""
if transport != "tcp":
    try:
        tannery.Client(target, transport="tcp").transport
    except Exception as exc:
        why = str(exc)
print(json.dumps({"uid": os.getuid(), "readable": readable, "connected": connected, "transport": transport,
                  "same": same, "why": why}))
"""


def test_another_local_user_reads_no_file_and_reaches_no_socket_and_its_client_falls_back(other_user):
    """The data directory under a 0755 parent (so that only its own modes stand in the way): the
    other user can open no file or directory under it, connecting to the socket is refused, and
    a client of that user with transport "auto" takes the data port and fetches the same bytes."""
    parent = Path(tempfile.mkdtemp(prefix="tannery-private-"))
    try:
        parent.chmod(0o755)
        with running_server(parent) as server:
            with tannery.Client(server.target, transport="grpc") as client:
                client.store("w", {"a": np.arange(1 << 16, dtype=np.float32)})
            paths = [p for p in modes_under(server.data_dir) if not p.endswith(".sock")]
            done = subprocess.run(
                [sys.executable, "-c", _AS_OTHER_USER, str(other_user.pw_uid), str(other_user.pw_gid),
                 json.dumps(paths), str(server.data_paths.socket_path), server.target],
                capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent,
                env={**os.environ, "HOME": "/tmp"})
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        assert seen["uid"] == other_user.pw_uid
        assert seen["readable"] == [], f"another user could open {seen['readable']}"
        assert seen["connected"] == "PermissionError"
        assert seen["transport"] == "tcp" and seen["same"], seen["why"]
    finally:
        shutil.rmtree(parent, ignore_errors=True)
