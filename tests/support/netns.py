"""Several "hosts" on one machine: network namespaces on a bridge.

Layout: a hub namespace holds a bridge; each host namespace has one veth
(``veth0``, address ``10.213.0.<i+1>/24``; both can be chosen, as the
two-host walkthrough's ``eth0`` at ``10.0.0.5`` and ``10.0.0.6``) whose
other end sits on the bridge. Nothing is created in the root namespace, so the tests touch no
address of the machine's own. Partition a host with :meth:`Hosts.down`
(its hub-side link goes down: packets vanish, no RST, exactly what a pulled
cable looks like), slow its link with :meth:`Hosts.shape` (token bucket).

Peers in the namespaces run UCX over TCP on ``veth0`` only
(:data:`UCX_ENV`): left alone, UCX would find the other process on the
same machine and copy with CMA, past the network we are testing.

This kernel (Firecracker guest, 6.18) has no ``netem`` qdisc and no tc
classifiers, so latency and loss are not available at the link; ``tbf``
rate limiting is, and control-plane delay and loss come from
:mod:`tests.support.faults` inside the peers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from typing import Final

SUBNET: Final = "10.213.0"
UCX_ENV: Final = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "veth0"}


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def require_ip() -> None:
    """No ``ip`` is an environment that cannot run these tests: fail."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise RuntimeError("iproute2 (ip, tc) is required for the netns tests")
    if os.geteuid() != 0:
        raise RuntimeError("the netns tests need root (CAP_NET_ADMIN)")


class Hosts:
    """``n`` namespaces on one bridge; :meth:`close` removes everything."""

    def __init__(
        self, n: int, subnet: str = SUBNET, first: int = 1, ifname: str = "veth0"
    ) -> None:
        """``n`` hosts at ``subnet.first`` onwards, each with its link named
        ``ifname``. The addresses exist only inside the namespaces, so any
        subnet is safe to use, the machine's own included."""
        require_ip()
        self.tag = uuid.uuid4().hex[:6]
        self.hub = f"p2pkv-{self.tag}-hub"
        self.names = [f"p2pkv-{self.tag}-{i}" for i in range(n)]
        self.addrs = [f"{subnet}.{first + i}" for i in range(n)]
        self.ifname = ifname
        self._hub_if = [f"pk{self.tag}{i}h" for i in range(n)]
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        ip("netns", "add", self.hub)
        self._made.append(self.hub)
        hub = ("-n", self.hub)
        ip(*hub, "link", "set", "lo", "up")
        ip(*hub, "link", "add", "br0", "type", "bridge")
        ip(*hub, "link", "set", "br0", "up")
        for ns, addr, hub_if in zip(self.names, self.addrs, self._hub_if, strict=True):
            ip("netns", "add", ns)
            self._made.append(ns)
            tmp = f"pk{self.tag}{ns[-1]}n"
            ip(*hub, "link", "add", hub_if, "type", "veth", "peer", "name", tmp)
            ip(*hub, "link", "set", tmp, "netns", ns)
            ip("-n", ns, "link", "set", tmp, "name", self.ifname)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", self.ifname)
            ip("-n", ns, "link", "set", self.ifname, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip(*hub, "link", "set", hub_if, "master", "br0")
            ip(*hub, "link", "set", hub_if, "up")

    def down(self, i: int) -> None:
        """Partition host ``i``: its link goes dark, no packet in or out."""
        ip("-n", self.hub, "link", "set", self._hub_if[i], "down")

    def up(self, i: int) -> None:
        ip("-n", self.hub, "link", "set", self._hub_if[i], "up")

    def shape(self, i: int, rate: str = "20mbit") -> None:
        """Token-bucket both directions of host ``i``'s link."""
        for ns, dev in ((self.hub, self._hub_if[i]), (self.names[i], self.ifname)):
            subprocess.run(
                [
                    *("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root"),
                    *("tbf", "rate", rate, "burst", "32kb", "latency", "400ms"),
                ],
                check=True,
                capture_output=True,
            )

    def unshape(self, i: int) -> None:
        for ns, dev in ((self.hub, self._hub_if[i]), (self.names[i], self.ifname)):
            subprocess.run(
                ["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                check=False,
                capture_output=True,
            )

    def close(self) -> None:
        """Delete every namespace made (their veths go with them)."""
        for ns in reversed(self._made):
            ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
