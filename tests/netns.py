"""Two 'hosts' on this machine for network-fault tests: two network namespaces, each with its own
address on one veth link between them, made with `ip netns` (root). Everything made here is removed
on exit; where namespaces cannot be made, the test is skipped with the reason.

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
        hosts.ip(i, "addr", "add", f"{hosts.addresses[i]}/24", "dev", hosts.links[i])
        hosts.ip(i, "link", "set", hosts.links[i], "up")
        hosts.ip(i, "link", "set", "lo", "up")
        if resolve_hostname:
          os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
          with open(f"/etc/netns/{ns}/hosts", "w") as f:
            f.write(f"127.0.0.1 localhost\n{hosts.addresses[i]} {socket.gethostname()}\n")
    except (OSError, subprocess.SubprocessError) as e:
      detail = getattr(e, "stderr", None) or e
      pytest.skip(f"network namespaces cannot be made here (needs root and `ip netns`): {detail}")
    yield hosts
  finally:
    for ns in made:
      subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)  # Takes its veth end along.
      shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
