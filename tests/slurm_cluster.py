"""A real single-node SLURM on this machine, for tests of launch/slurm/train.sbatch.

  with slurm_cluster.running() as env:  # The environment for sbatch, squeue, ...: SLURM_CONF is set.
    subprocess.run(["sbatch", "--wait", ...], env=env, timeout=...)

  python tests/slurm_cluster.py [--install]   # says whether SLURM can run here, and if not why

Everything lives in one temporary folder: a fresh munge key and a private munge socket (a system
munged, if any, is left alone), slurm.conf, state, spool and logs. The daemons run in the foreground
as our children (munged -F, slurmctld -D, slurmd -D), so they are stopped by PID; anything a job left
running is found by the SLURM_CONF path in its environment and killed too.
"""

import argparse
import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

# The programs the tests and the daemons need, and the Debian/Ubuntu packages that provide them.
DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")
CLIENTS = ("sbatch", "srun", "sinfo", "squeue", "scancel", "scontrol")
BINARIES = DAEMONS + CLIENTS
APT_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
# Daemons live in sbin, which a non-login shell's PATH may lack.
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])


class Unavailable(RuntimeError):
  """SLURM cannot run here; the message says why, with the daemon's log tail where one failed."""


def which(name: str) -> str | None:
  return shutil.which(name, path=_SEARCH_PATH)


def missing_binaries() -> list[str]:
  return [b for b in BINARIES if which(b) is None]


def install(timeout_s: float = 300) -> str | None:
  """Installs the SLURM packages with apt-get when any binary is missing; returns why not, or None."""
  missing = missing_binaries()
  if not missing:
    return None
  why = f"SLURM binaries missing ({', '.join(missing)})"
  if shutil.which("apt-get") is None:
    return f"{why}, and there is no apt-get to install {' '.join(APT_PACKAGES)}"
  if os.geteuid() != 0:
    return f"{why}, and installing them needs root: apt-get install {' '.join(APT_PACKAGES)}"
  env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
  deadline = time.monotonic() + timeout_s
  for argv in (
    ["apt-get", "update", "-qq"],
    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES],
  ):
    left = deadline - time.monotonic()
    try:
      r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=max(1.0, left))
    except subprocess.TimeoutExpired:
      return f"{why}; `{' '.join(argv)}` did not finish within {timeout_s:g} s"
    if r.returncode != 0:
      return f"{why}; `{' '.join(argv)}` failed ({r.returncode}): {_tail(r.stdout + r.stderr, 5)}"
  if missing := missing_binaries():
    return f"apt-get installed {' '.join(APT_PACKAGES)} but these are still missing: {', '.join(missing)}"
  return None


def why_unavailable(install_missing: bool = False, timeout_s: float = 60) -> str | None:
  """Why SLURM cannot run here, or None when a cluster started and answered (it is stopped again).

  With install_missing, missing binaries are first installed with apt-get (root only).
  """
  if install_missing and (reason := install()):
    return reason
  if missing := missing_binaries():
    return f"SLURM binaries missing ({', '.join(missing)}); as root: apt-get install {' '.join(APT_PACKAGES)}"
  try:
    with running(timeout_s=timeout_s):
      return None
  except Unavailable as e:
    return str(e)


def _tail(text: str, lines: int) -> str:
  return " | ".join(line for line in text.strip().splitlines()[-lines:])


def _file_tail(path: str, lines: int = 15) -> str:
  try:
    with open(path, errors="replace") as f:
      return _tail(f.read(), lines) or "(empty)"
  except OSError:
    return "(no log)"


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _node_name() -> str:
  """This machine's host name when it resolves, else localhost.

  As on a real cluster, a node name is a host name: JAX's own SLURM detection, for one, uses it as
  the coordinator's address.
  """
  name = socket.gethostname().split(".")[0]
  try:
    socket.gethostbyname(name)
    return name
  except OSError:
    return "localhost"


def slurm_conf(d: str, node: str, cpus: int, ctld_port: int, slurmd_port: int) -> str:
  user = getpass.getuser()
  return f"""\
# A single-node cluster on 127.0.0.1 for tests; written by tests/slurm_cluster.py.
ClusterName=localtest
SlurmctldHost={node}(127.0.0.1)
SlurmUser={user}
SlurmdUser={user}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={d}/munge.socket
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
# No cgroups in a container: track processes by parentage, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# The node declares {cpus} CPUs whatever the machine has, so several tasks fit on a small CI machine.
SlurmdParameters=config_overrides
ReturnToService=2
# Finished jobs leave the controller quickly, and `sbatch --wait` notices within ~2 s.
MinJobAge=4
KillWait=5
MailProg=/bin/true
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _our_processes(conf_path: str) -> list[int]:
  """PIDs of live processes whose environment holds SLURM_CONF=conf_path: slurmstepd and job tasks."""
  needle = f"SLURM_CONF={conf_path}".encode()
  found = []
  for entry in os.listdir("/proc"):
    if entry.isdigit() and int(entry) != os.getpid():
      try:
        with open(f"/proc/{entry}/environ", "rb") as f:
          if needle in f.read().split(b"\0"):
            found.append(int(entry))
      except OSError:
        pass  # Ended while we looked, or not ours to read.
  return found


@contextlib.contextmanager
def running(base_dir: str | None = None, cpus: int = 8, timeout_s: float = 60) -> Iterator[dict[str, str]]:
  """Starts munged, slurmctld and slurmd; yields the environment for SLURM's clients; always stops them.

  The environment is os.environ with SLURM_CONF set, and without the SLURM_/SBATCH_/SRUN_ variables of
  any allocation this runs in (CI on a cluster): they would steer the clients to another job, and
  leak into the jobs submitted here.

  Files go to base_dir (kept, e.g. a test's tmp_path) or to a temporary folder (removed). Raises
  Unavailable with the reason and the failing daemon's log tail if the node is not idle in timeout_s.
  """
  if missing := missing_binaries():
    raise Unavailable(f"SLURM binaries missing: {', '.join(missing)}")
  own_dir = base_dir is None
  # Short path: munge's socket path must fit in a sockaddr_un (108 bytes).
  d = tempfile.mkdtemp(prefix="slurm-") if own_dir else os.path.abspath(base_dir)
  for sub in ("state", "spool"):  # Fresh: jobs of an earlier cluster in base_dir must not come back.
    shutil.rmtree(os.path.join(d, sub), ignore_errors=True)
    os.makedirs(os.path.join(d, sub))
  conf = os.path.join(d, "slurm.conf")
  node = _node_name()
  with open(conf, "w") as f:
    f.write(slurm_conf(d, node, cpus, _free_port(), _free_port()))
  key = os.path.join(d, "munge.key")
  with contextlib.suppress(FileNotFoundError):
    os.remove(key)  # Read-only from an earlier run; munged refuses a key others may read.
  with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400), "wb") as f:
    f.write(os.urandom(1024))
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
  env["SLURM_CONF"] = conf
  daemons: dict[str, subprocess.Popen] = {}

  def start(name: str, argv: list[str]) -> None:
    with open(os.path.join(d, f"{name}.out"), "wb") as out:
      daemons[name] = subprocess.Popen(
        argv,
        env=env,
        cwd=d,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
      )

  def failure(what: str) -> Unavailable:
    logs = []
    stopped = [name for name, p in daemons.items() if p.poll() is not None]
    for name in stopped or daemons:  # The logs of those that died, else of all.
      p = daemons[name]
      state = "running" if p.poll() is None else f"exited {p.returncode}"
      log = os.path.join(d, f"{name}.log")
      logs.append(
        f"{name} ({state}): {_file_tail(log if os.path.exists(log) else os.path.join(d, f'{name}.out'))}"
      )
    return Unavailable(f"local SLURM did not start: {what}. " + " || ".join(logs))

  try:
    sock = os.path.join(d, "munge.socket")
    start(
      "munged",
      [
        which("munged"),
        "-F",
        "--force",
        f"--socket={sock}",
        f"--key-file={key}",
        f"--log-file={d}/munged.log",
      ]
      + [f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed"],
    )
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(sock):
      if daemons["munged"].poll() is not None or time.monotonic() > deadline:
        raise failure("munged did not create its socket")
      time.sleep(0.05)
    start("slurmctld", [which("slurmctld"), "-D", "-i", "-f", conf])
    start("slurmd", [which("slurmd"), "-D", "-N", node, "-f", conf])
    state = ""
    while state != "idle":
      for name, p in daemons.items():
        if p.poll() is not None:
          raise failure(f"{name} exited with code {p.returncode}")
      if time.monotonic() > deadline:
        raise failure(f"node state {state or 'unknown'!r}, not idle, after {timeout_s:g} s")
      time.sleep(0.2)
      try:
        r = subprocess.run(
          [which("sinfo"), "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10
        )
        state = r.stdout.strip()
      except subprocess.TimeoutExpired:
        state = ""
    yield env
  finally:
    _stop(daemons, env, conf)
    if own_dir:
      shutil.rmtree(d, ignore_errors=True)


def _stop(daemons: dict[str, subprocess.Popen], env: dict[str, str], conf: str) -> None:
  """Cancels the jobs, stops the daemons by PID, then kills whatever the jobs left running."""
  ctld = daemons.get("slurmctld")
  if ctld is not None and ctld.poll() is None and _jobs(env):
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
      subprocess.run(
        [which("scancel"), f"--user={getpass.getuser()}"], env=env, capture_output=True, timeout=10
      )
    deadline = time.monotonic() + 10  # KillWait=5: SIGTERM, then SIGKILL 5 s later.
    while time.monotonic() < deadline and _jobs(env):
      time.sleep(0.2)
  for name in ("slurmd", "slurmctld", "munged"):  # Reverse order of start.
    p = daemons.get(name)
    if p is None:
      continue
    if p.poll() is None:
      p.terminate()
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait(timeout=10)
  for pid in _our_processes(conf):  # slurmstepd and tasks that outlived their daemons.
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, signal.SIGKILL)


def _jobs(env: dict[str, str]) -> list[str]:
  """Ids of the jobs the controller still knows as pending, running or completing."""
  try:
    r = subprocess.run(
      [which("squeue"), "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=10
    )
  except (subprocess.TimeoutExpired, OSError):
    return []
  return r.stdout.split()


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description="Say whether a local single-node SLURM can run here.")
  parser.add_argument("--install", action="store_true", help="apt-get install missing packages (root)")
  args = parser.parse_args(argv)
  reason = why_unavailable(install_missing=args.install)
  print(
    f"SLURM unavailable: {reason}" if reason else "SLURM is available: a local cluster started and answered"
  )
  return 1 if reason else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
