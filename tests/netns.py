"""Hosts simulated on this machine: network namespaces on one bridge, each behind a link shaped
by ``tc tbf`` (1 Gbit/s by default), for the relay tests and benchmark.

    with Hosts(9, rate="1gbit") as hosts:          # host 0: the server and trainer; 1..8: workers
        hosts.popen(3, [sys.executable, "-m", ...])  # runs in host 3's namespace
        hosts.address(0)                           # "10.213.7.1"

Each host's veth is shaped both ways (its side: what it sends; the bridge's side: what it
receives), as a host's network card is. Traffic goes only between these namespaces' own
addresses. Everything is removed at the end, a failing test's too: every process still running
in a namespace is killed, then the namespaces and the bridge go (a veth goes with its namespace). :func:`unavailable` says why namespaces cannot be made here (not root, no ``ip``),
for a test to skip naming it.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from typing import Any, Sequence


def unavailable() -> str | None:
    """Why network namespaces cannot be made on this machine (None: they can)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc commands (iproute2) are not installed"
    if os.geteuid() != 0:
        return "making network namespaces takes root"
    probe = f"tnyprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    command = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")


class Hosts:
    """``count`` namespaces joined by a bridge, each behind a link of ``rate`` (tc tbf)."""

    def __init__(self, count: int, rate: str = "1gbit") -> None:
        self.count, self.rate = count, rate
        tag = random.randrange(1, 250)
        self.tag = f"tny{os.getpid() % 10000}{tag}"[:9]
        self.subnet = f"10.213.{tag}"
        self.bridge = f"{self.tag}br"
        self.names = [f"{self.tag}n{i}" for i in range(count)]
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> Hosts:
        try:
            _ip("ip", "link", "add", self.bridge, "type", "bridge")
            _ip("ip", "link", "set", self.bridge, "up")
            for index, ns in enumerate(self.names):
                self._add(index, ns)
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, index: int, ns: str) -> None:
        outside, inside = f"{self.tag}h{index}", f"{self.tag}v{index}"
        _ip("ip", "netns", "add", ns)
        _ip("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("ip", "link", "set", inside, "netns", ns)
        _ip("ip", "link", "set", outside, "master", self.bridge)
        _ip("ip", "link", "set", outside, "up")
        _ip("ip", "addr", "add", f"{self.address(index)}/24", "dev", inside, ns=ns)
        _ip("ip", "link", "set", inside, "up", ns=ns)
        _ip("ip", "link", "set", "lo", "up", ns=ns)
        shape = ["root", "tbf", "rate", self.rate, "burst", "512kb", "latency", "20ms"]
        _ip("tc", "qdisc", "add", "dev", inside, *shape, ns=ns)  # what the host sends
        _ip("tc", "qdisc", "add", "dev", outside, *shape)  # what it receives

    def interface(self, index: int) -> str:
        """The name of host ``index``'s network interface, inside its namespace."""
        return f"{self.tag}v{index}"

    def address(self, index: int) -> str:
        return f"{self.subnet}.{index + 1}"

    def command(self, index: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[index], *argv]

    def popen(self, index: int, argv: Sequence[str], **options: Any) -> subprocess.Popen:
        """Start ``argv`` in host ``index``'s namespace (killed at the end if still running)."""
        process = subprocess.Popen(self.command(index, argv), **options)
        self.processes.append(process)
        return process

    def shape(self, index: int, rate: str) -> None:
        """Change host ``index``'s link to ``rate``, both ways (a slow host)."""
        shape = ["root", "tbf", "rate", rate, "burst", "512kb", "latency", "20ms"]
        _ip("tc", "qdisc", "change", "dev", f"{self.tag}v{index}", *shape, ns=self.names[index])
        _ip("tc", "qdisc", "change", "dev", f"{self.tag}h{index}", *shape)

    def link(self, index: int, up: bool) -> None:
        """Take host ``index``'s link down (a cable pulled) or up again."""
        _ip("ip", "link", "set", f"{self.tag}h{index}", "up" if up else "down")

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.names:  # whatever still runs in a namespace (started by others than popen) goes with it
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (OSError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["Hosts", "unavailable"]
