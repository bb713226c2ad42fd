"""Runs P real processes of main.py on this machine, joined by jax.distributed over 127.0.0.1.

  python launch/local.py --processes=2 --cpu_devices=4 -- --config=configs/smoke_cpu.py --workdir=runs/mp

Every process gets `--coordinator_address=127.0.0.1:PORT --num_processes=P --process_id=I
--cpu_devices=D` followed by the flags after `--`. Process I's peer service (trainer/cluster/peers.py:
the link probes between every pair of processes) listens on PORT + 1 + I (PEER_PORT_BASE + I when that
is set); a port that is taken falls back to one the kernel picks, which the peers learn. Their output
comes back line by line, prefixed `[pI] `, less known library chatter (launch/process_output.py;
`--verbose`, or `--verbosity` among main.py's flags, shows every line). When one process exits non-zero
the others are stopped (SIGTERM, then SIGKILL after --grace_s) and the launcher exits with that code;
it exits 0 when all succeed.

SIGINT and SIGTERM are passed on to every process; main.py then saves at a step all agree on and
exits 0. The launcher exits with their result, as without a signal: 0 when every process stopped
cleanly, else the first failing process's code. Only when it has to kill them (a second signal, or
processes still running --grace_s seconds after the first) does it exit 128 + N, N the signal.

A process in a jax.distributed job does not die of SIGTERM: JAX's preemption service catches it
and only a training loop that polls `multihost_utils.reached_preemption_sync_point` acts on it.

`--max_restarts=N` relaunches the whole job when it failed, up to N times, and main.py resumes from the
newest checkpoint; `--min_processes=K` (`--elastic`: K = 1) lets it continue without a slot that cannot
come back. launch/restarts.py runs that loop and says how; launch/restart_policy.py says which exit
codes restart.

`--netns=NS0,NS1,...` (as root) runs process I inside network namespace NSI, each with its own
address, as on separate hosts (tests/netns.py builds them: network faults between real interfaces);
the coordinator is NS0's address. On CPU, Gloo advertises the address this machine's host name
resolves to: in a namespace that must be the namespace's own, e.g. through /etc/netns/NSI/hosts,
which `ip netns exec` puts in place of /etc/hosts (across real hosts: each host's name must resolve
to its own interface, not 127.0.1.1).
"""

import argparse
import ctypes
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), REPO]  # Its neighbours; trainer.rundir.
from process_output import LinePump, log  # noqa: E402
from restarts import supervise  # noqa: E402

# Short jax.distributed timeouts (seconds), read by trainer/cluster/runtime.py: on one machine every process
# starts within seconds and finishes within seconds of the others, so a peer that never connects or
# never reaches the exit barrier should end the job in seconds, not minutes. One that goes silent is
# named by trainer/cluster/liveness.py within watchdog.peer_timeout_s (at most half the heartbeat's 60 s).
CHILD_ENV_DEFAULTS = {
  "JAX_INIT_TIMEOUT_S": "60",
  "JAX_HEARTBEAT_TIMEOUT_S": "60",
  "JAX_SHUTDOWN_TIMEOUT_S": "30",
}


def free_port() -> int:
  """A TCP port free on loopback now. Another program could take it before process 0 binds it;
  on a test machine that race is rare, and the job then fails at start-up rather than misbehaving."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _die_with_parent() -> None:
  """Runs in each child before exec: the kernel sends it SIGKILL if the launcher dies, even by
  SIGKILL, so no orphaned process holds a port or a collective."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG (Linux).
  except (OSError, AttributeError):
    pass  # Not Linux: the launcher's own cleanup still applies.


class Job:
  """The processes of one job: started together, watched together, stopped together."""

  def __init__(
    self,
    argv_per_process: list[list[str]],
    env: dict[str, str],
    grace_s: float,
    keep_all: bool = False,
    fail_fast: bool = False,
  ):
    self.argv_per_process, self.env, self.grace_s = argv_per_process, env, grace_s
    self.keep_all, self.fail_fast = keep_all, fail_fast
    self.procs: list[subprocess.Popen] = []
    self.outputs: list[LinePump] = []
    self.signalled: int | None = None
    self.killed = False  # Whether the launcher sent SIGKILL to a process it saw running.
    # The first process to fail: (index, its return code, when the launcher saw it exit).
    self.first_failure: tuple[int, int, float] | None = None
    self.ended_at: float | None = None  # When the last process had exited.

  def start(self) -> None:
    for i, argv in enumerate(self.argv_per_process):
      if self.signalled is not None:
        return  # Interrupted while starting: start no more.
      # Own session: a Ctrl-C in the terminal reaches the launcher only, which forwards it
      # exactly once; and killpg also reaches anything a process started (e.g. Grain workers).
      p = subprocess.Popen(
        argv,
        cwd=REPO,
        env=self.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
      )
      self.procs.append(p)
      prefix = f"[p{i}] ".encode()
      self.outputs.append(LinePump(p.stdout, sys.stdout.buffer, prefix, self.keep_all))
      self.outputs.append(LinePump(p.stderr, sys.stderr.buffer, prefix, self.keep_all))

  def kill_all(self, sig: int) -> None:
    for p in self.procs:
      if p.poll() is None:
        self.killed = self.killed or sig == signal.SIGKILL
        try:
          os.killpg(p.pid, sig)
        except ProcessLookupError:
          pass

  def on_signal(self, signum, frame) -> None:
    if self.signalled is None:
      self.signalled = signum
      log(f"got {signal.Signals(signum).name}; passing it to every process")
      self.kill_all(signum)
    else:
      log("second signal; killing every process")
      self.kill_all(signal.SIGKILL)

  def _running(self) -> list[int]:
    return [i for i, p in enumerate(self.procs) if p.poll() is None]

  def wait(self) -> int:
    """Waits for every process and returns the launcher's exit code."""
    # One waiter per process reports exits in the order they happen, so the process that failed
    # first is named even when its peers fail a moment later (their collectives lost a partner).
    exits: queue.Queue[int] = queue.Queue()
    for i, p in enumerate(self.procs):
      threading.Thread(target=lambda i=i, p=p: (p.wait(), exits.put(i)), daemon=True).start()
    failure, left, deadline = None, len(self.procs), None
    while left:
      if deadline is None and (failure is not None or self.signalled is not None):
        # From the first failure or signal on, the rest get --grace_s seconds to end.
        deadline = time.monotonic() + self.grace_s
      if deadline is not None and time.monotonic() >= deadline and self._running():
        log(f"processes {self._running()} still running {self.grace_s:g} s later; killing them")
        self.kill_all(signal.SIGKILL)
        deadline = float("inf")  # Once: they die within moments of SIGKILL.
      try:
        i = exits.get(timeout=0.05)
      except queue.Empty:
        continue
      left -= 1
      code = self.procs[i].returncode
      if code != 0 and failure is None:
        failure = (i, 128 - code if code < 0 else code)  # Killed by signal N: the shell's 128 + N.
        self.first_failure = (i, code, time.time())
        # After a signal the processes are stopping already; a failure alone stops the others.
        running = self._running() if self.signalled is None else []
        log(f"process {i} exited with code {code}" + (f"; stopping {running}" if running else ""))
        if running:
          self.kill_all(signal.SIGKILL if self.fail_fast else signal.SIGTERM)
    self.ended_at = time.time()
    for out in self.outputs:
      out.thread.join(timeout=5)  # A grandchild holding a pipe open must not hang the launcher.
    if (
      self.signalled is not None and self.killed and any(p.returncode == -signal.SIGKILL for p in self.procs)
    ):
      return 128 + self.signalled  # Killed mid-stop: whatever they were saving may be incomplete.
    # After a signal as without one: a preempted main.py that saved exits 0 (PREEMPTED_EXIT_CODE aside).
    return failure[1] if failure is not None else 0


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="launch/local.py",
    description="Run P processes of main.py on 127.0.0.1, joined by jax.distributed.",
    usage=(
      "%(prog)s --processes=P --cpu_devices=D [--grace_s=S] [--verbose] [--max_restarts=N "
      "[--restart_backoff_s=S] [--elastic | --min_processes=K]] -- MAIN_FLAGS..."
    ),
  )
  parser.add_argument("--processes", type=int, required=True, help="number of processes (P)")
  parser.add_argument("--cpu_devices", type=int, required=True, help="logical CPU devices per process (D)")
  parser.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1; 0 picks a free one")
  parser.add_argument(
    "--grace_s", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL when stopping processes"
  )
  parser.add_argument(
    "--main", default=os.path.join(REPO, "main.py"), help="program every process runs (tests pass a stub)"
  )
  parser.add_argument(
    "--verbose",
    action="store_true",
    help="show every line of output, library chatter included",
  )
  parser.add_argument("--max_restarts", type=int, default=0, help="relaunch a failed job up to N times")
  parser.add_argument("--restart_backoff_s", type=float, default=1.0, help="seconds before a relaunch")
  parser.add_argument(
    "--min_processes", type=int, default=None, help="drop a slot that cannot come back, down to K processes"
  )
  parser.add_argument("--elastic", action="store_true", help="--min_processes=1")
  parser.add_argument(
    "--netns",
    default=None,
    help="NS0,NS1,...: process I runs in network namespace NSI (as root); the coordinator is NS0's address",
  )
  if "--" in argv:
    cut = argv.index("--")
    own, main_flags = argv[:cut], argv[cut + 1 :]
  else:
    own, main_flags = argv, []
  args = parser.parse_args(own)
  if args.processes < 1:
    parser.error(f"--processes={args.processes}: must be at least 1")
  if args.cpu_devices < 1:
    parser.error(f"--cpu_devices={args.cpu_devices}: must be at least 1")
  if args.grace_s < 0:
    parser.error(f"--grace_s={args.grace_s}: must not be negative")
  if args.max_restarts < 0 or args.restart_backoff_s < 0:
    parser.error("--max_restarts and --restart_backoff_s must not be negative")
  if args.elastic and args.min_processes is not None:
    parser.error("--elastic is --min_processes=1: give one of them")
  args.min_processes = (
    1 if args.elastic else (args.processes if args.min_processes is None else args.min_processes)
  )
  if not 1 <= args.min_processes <= args.processes:
    parser.error(f"--min_processes={args.min_processes}: must be between 1 and --processes={args.processes}")
  reserved = ("--coordinator_address", "--num_processes", "--process_id", "--cpu_devices")
  for flag in main_flags:
    if flag.split("=", 1)[0] in reserved:
      parser.error(f"{flag.split('=', 1)[0]} is set by the launcher; remove it after `--`")
  args.main_flags = main_flags
  args.netns = args.netns.split(",") if args.netns else None
  if args.netns and (len(args.netns) != args.processes or args.min_processes != args.processes):
    parser.error(f"--netns names one namespace per process ({args.processes}), and a fixed number of them")
  # Asking main.py for the libraries' logs (`--verbosity=0`, absl's `-v`) asks for all their lines too.
  args.verbose = args.verbose or any(f.split("=", 1)[0].lstrip("-") in ("verbosity", "v") for f in main_flags)
  return args


def namespace_address(namespace: str) -> str:
  """The first IPv4 address of a network namespace's own interfaces (not loopback)."""
  out = subprocess.run(
    ["ip", "-n", namespace, "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True
  )
  addresses = [line.split()[3].split("/")[0] for line in out.stdout.splitlines()]
  if out.returncode or not addresses:
    raise SystemExit(f"error: --netns: namespace {namespace} has no IPv4 address ({out.stderr.strip()})")
  return addresses[0]


def _argv(args, processes: int, host: str, port: int) -> list[list[str]]:
  return [
    [
      *(["ip", "netns", "exec", args.netns[i]] if args.netns else []),
      sys.executable,
      args.main,
      f"--coordinator_address={host}:{port}",
      f"--num_processes={processes}",
      f"--process_id={i}",
      f"--cpu_devices={args.cpu_devices}",
      *args.main_flags,
    ]
    for i in range(processes)
  ]


def _workdir(main_flags: list[str]) -> str | None:
  """main.py's --workdir, written `--workdir=DIR` or `--workdir DIR`."""
  for i, flag in enumerate(main_flags):
    if flag.startswith("--workdir="):
      return flag.split("=", 1)[1]
    if flag == "--workdir" and i + 1 < len(main_flags):
      return main_flags[i + 1]
  return None


def main(argv: list[str]) -> int:
  args = parse_args(argv)
  env = dict(os.environ)
  for key, value in CHILD_ENV_DEFAULTS.items():
    env.setdefault(key, value)
  env["PYTHONUNBUFFERED"] = "1"  # Lines arrive as they are printed, not when a buffer fills.
  # The job's peer-service secret (trainer/cluster/peers.py), kept for its restarts: only its processes
  # (and their user) can read it.
  env.setdefault("PEER_SECRET", secrets.token_hex(32))  # peers.SECRET_ENV (no JAX imported here).

  def new_job(processes: int, env: dict[str, str]) -> Job:
    """One launch of `processes` processes, on a port of its own unless --port fixes it."""
    port = args.port or free_port()
    # Only the loopback interface (or NS0's own address): nothing else can reach the coordinator.
    host = namespace_address(args.netns[0]) if args.netns else "127.0.0.1"
    env["JAX_COORDINATOR_BIND_ADDRESS"] = f"{host}:{port}"
    argv_per_process = _argv(args, processes, host, port)
    return Job(argv_per_process, env, args.grace_s, args.verbose, fail_fast=args.max_restarts > 0)

  return supervise(
    new_job,
    env,
    args.processes,
    max_restarts=args.max_restarts,
    restart_backoff_s=args.restart_backoff_s,
    min_processes=args.min_processes,
    workdir=_workdir(args.main_flags),
  )


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
