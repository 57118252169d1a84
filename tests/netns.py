"""Nodes of a test as hosts of their own: one Linux network namespace per node, each with one
address on a bridge (docs/multinode.md). Node r is `10.77.0.{r+1}/24` on its `eth0`, a veth
whose other end is a port of a bridge in one more namespace (the switch), so that nothing of
the host's own network changes and deleting the namespaces removes every link. A launcher runs
inside with `ip netns exec NAME ...` (`prefix`). Needs root and iproute2 (`ip`); where the
namespaces cannot be made (no root, a container without CAP_SYS_ADMIN) `skip_reason` says why.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess

SUBNET = "10.77.0"  # private to the namespaces: the host never sees it


def ip_command() -> str | None:
    return shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.path.exists(p)), None)


class Namespaces:
    """`n` node namespaces and their switch; `close()` deletes them all, also after a failure to make
    them. Raises NetnsUnavailable (with the command's error) when they cannot be made."""

    def __init__(self, n: int):
        self.ip = ip_command()
        if self.ip is None:
            raise NetnsUnavailable("no `ip` command (Debian: apt-get install iproute2)")
        tag = secrets.token_hex(3)  # tests of other sessions make theirs at the same time
        self.switch = f"tandem-{tag}-sw"
        self.names = [f"tandem-{tag}-n{r}" for r in range(n)]
        self._made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _run(self, *args: str) -> None:
        out = subprocess.run([self.ip, *args], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")

    def _make(self) -> None:
        for name in (self.switch, *self.names):
            self._run("netns", "add", name)
            self._made.append(name)
        self._run("-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._run("-n", self.switch, "link", "set", "br0", "up")
        for r, name in enumerate(self.names):
            self._run("-n", self.switch, "link", "add", f"p{r}", "type", "veth", "peer", "name", "eth0", "netns", name)
            self._run("-n", self.switch, "link", "set", f"p{r}", "master", "br0", "up")
            self._run("-n", name, "addr", "add", f"{self.address(r)}/24", "dev", "eth0")
            self._run("-n", name, "link", "set", "eth0", "up")
            self._run("-n", name, "link", "set", "lo", "up")  # a node's own roles reach each other there too

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def prefix(self, rank: int) -> list[str]:
        """What runs a command inside node `rank`'s namespace."""
        return [self.ip, "netns", "exec", self.names[rank]]

    def close(self) -> None:
        """Delete every namespace made (their links and the bridge go with them); run the
        processes inside down first: a namespace lives on, unnamed, while a process holds it."""
        for name in reversed(self._made):
            subprocess.run([self.ip, "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


def listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket, IPv4 and IPv6, listening in process `pid`'s network
    namespace (/proc/PID/net/tcp and tcp6 are the namespace's, whoever reads them)."""
    out = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":  # TCP_LISTEN
                    addr, port = local.split(":")
                    raw = bytes.fromhex(addr)  # 32-bit words in host (little-endian) order
                    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    out.add((str(ipaddress.ip_address(packed)), int(port, 16)))
    return out
