"""'Hosts' on this machine for network-fault tests, made with `ip netns` (root): two network namespaces,
each with its own address on one veth link between them (two_hosts), or several on one bridge, as
hosts on one switch (bridged_hosts). Everything made here is removed on exit; where namespaces cannot
be made, the test is skipped with the reason.

The machine's host name resolves, inside each namespace, to that namespace's own address (through
/etc/netns/NAME/hosts, which `ip netns exec` mounts over /etc/hosts): Gloo advertises that address
to its peers, as a real host's name resolves to its own interface.
"""

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess

import pytest


@dataclasses.dataclass
class Hosts:
  namespaces: list[str]
  links: list[str]  # The veth end inside each namespace.
  addresses: list[str]

  def ip(self, i: int, *args: str) -> None:
    subprocess.run(["ip", "-n", self.namespaces[i], *args], check=True, capture_output=True, timeout=10)

  def cut(self) -> None:
    """A partition: the link between the two goes down (a pulled cable, a failed switch port)."""
    self.ip(1, "link", "set", self.links[1], "down")

  def heal(self) -> None:
    self.ip(1, "link", "set", self.links[1], "up")

  def cut_between(self, i: int, j: int) -> None:
    """Hosts i and j stop reaching each other (a blackhole route on each side), and every other host
    still reaches both: a bad route or firewall rule between two hosts, not a dead switch."""
    self.ip(i, "route", "add", "blackhole", f"{self.addresses[j]}/32")
    self.ip(j, "route", "add", "blackhole", f"{self.addresses[i]}/32")

  @contextlib.contextmanager
  def slow_link(self, i: int, rate: str):
    """Namespace i's outgoing traffic shaped to `rate` (a token bucket: a slow or congested link)."""
    shape = ["qdisc", "add", "dev", self.links[i], "root", "tbf", "rate", rate, "burst", "16kbit"]
    subprocess.run(["tc", "-n", self.namespaces[i], *shape, "latency", "400ms"], check=True, timeout=10)
    try:
      yield
    finally:
      subprocess.run(
        ["tc", "-n", self.namespaces[i], "qdisc", "del", "dev", self.links[i], "root"], timeout=10
      )


def _run(*argv: str) -> None:
  subprocess.run(argv, check=True, capture_output=True, text=True, timeout=10)


def _resolve_hostname_to(namespace: str, address: str) -> None:
  os.makedirs(f"/etc/netns/{namespace}", exist_ok=True)
  with open(f"/etc/netns/{namespace}/hosts", "w") as f:
    f.write(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")


def _remove(namespaces: list[str]) -> None:
  for ns in namespaces:
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)  # Takes its veth ends along.
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def _skip(e: Exception):
  detail = getattr(e, "stderr", None) or e
  pytest.skip(f"network namespaces cannot be made here (needs root and `ip netns`): {detail}")


LINK = "fab0"  # The link's name inside each namespace, the same on both, as a host's "eth0" would be.


@contextlib.contextmanager
def two_hosts(resolve_hostname: bool = True, subnet: int = 0):
  """`resolve_hostname=False` leaves /etc/hosts as it is: Gloo then needs main.py's
  --cpu_collectives_interface=fab0. Two pairs at once need different `subnet`s."""
  tag = f"{os.getpid() % 10_000}{subnet}"
  hosts = Hosts(
    namespaces=[f"tplns{tag}a", f"tplns{tag}b"],
    links=[LINK, LINK],
    addresses=[f"10.{213 + subnet}.{os.getpid() % 250}.{i}" for i in (1, 2)],
  )
  ends = [f"tpl{tag}a", f"tpl{tag}b"]
  made: list[str] = []
  try:
    try:
      for ns in hosts.namespaces:
        _run("ip", "netns", "add", ns)
        made.append(ns)
      _run("ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
      for i, ns in enumerate(hosts.namespaces):
        _run("ip", "link", "set", ends[i], "netns", ns)
        hosts.ip(i, "link", "set", ends[i], "name", LINK)
        _address(hosts, i, resolve_hostname)
    except (OSError, subprocess.SubprocessError) as e:
      _skip(e)
    yield hosts
  finally:
    _remove(made)


def _address(hosts, i: int, resolve_hostname: bool) -> None:
  """Host i's link up with its address (and loopback), its host name resolving to that address."""
  hosts.ip(i, "addr", "add", f"{hosts.addresses[i]}/24", "dev", hosts.links[i])
  hosts.ip(i, "link", "set", hosts.links[i], "up")
  hosts.ip(i, "link", "set", "lo", "up")
  if resolve_hostname:
    _resolve_hostname_to(hosts.namespaces[i], hosts.addresses[i])


@contextlib.contextmanager
def bridged_hosts(n: int = 3, subnet: int = 2):
  """n hosts on one bridge, which lives in a namespace of its own (the switch), so that nothing of the
  machine's own network changes. Each host's link is a veth whose other end is a port of the bridge;
  the host name resolves to each host's own address, as in two_hosts."""
  tag = f"{os.getpid() % 10_000}{subnet}"
  switch = f"tplns{tag}s"
  hosts = Hosts(
    namespaces=[f"tplns{tag}{i}" for i in range(n)],
    links=[LINK] * n,
    addresses=[f"10.{213 + subnet}.{os.getpid() % 250}.{i + 1}" for i in range(n)],
  )
  made: list[str] = []
  try:
    try:
      for ns in [switch, *hosts.namespaces]:
        _run("ip", "netns", "add", ns)
        made.append(ns)
      _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
      _run("ip", "-n", switch, "link", "set", "br0", "up")
      for i, ns in enumerate(hosts.namespaces):
        port = f"p{i}"
        _run("ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", LINK, "netns", ns)
        _run("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
        _address(hosts, i, resolve_hostname=True)
    except (OSError, subprocess.SubprocessError) as e:
      _skip(e)
    yield hosts
  finally:
    _remove(made)
