"""Process start-up: logical CPU devices and joining a multi-process job. Runs before JAX's backend."""

import ipaddress
import os
import sys
import threading
import time

import jax
from jax._src import distributed

from errors import UserError
from trainer import rundir

# Optional overrides of jax.distributed's timeouts (seconds). The local launcher sets short ones so a
# job whose peer never comes up, or dies, ends in seconds rather than JAX's 300 s / 100 s defaults.
INIT_TIMEOUT_ENV = "JAX_INIT_TIMEOUT_S"
HEARTBEAT_TIMEOUT_ENV = "JAX_HEARTBEAT_TIMEOUT_S"
SHUTDOWN_TIMEOUT_ENV = "JAX_SHUTDOWN_TIMEOUT_S"


# XLA:CPU ends the process (a C++ abort, exit 134) when the threads of one collective do not all
# arrive within its termination timeout: on a loaded host (another job on the same cores) a healthy
# run died this way. Our watchdog (watchdog.step_timeout_s, 300 s) and liveness check name a truly
# stuck or lost process first, so XLA's own bounds are set above every watchdog budget. Flags of
# yours in XLA_FLAGS come later and win.
CPU_COLLECTIVE_FLAGS = (
  "--xla_cpu_collective_call_warn_stuck_timeout_seconds=600",
  "--xla_cpu_collective_call_terminate_timeout_seconds=3600",
  "--xla_cpu_collective_timeout_seconds=3600",
)


# XLA:GPU picks nondeterministic kernels by default (atomic scatter-adds and reductions): on a GPU
# (benchmarks/gpu_check.sh) a 125M-parameter model's train step run twice from one state and batch
# differed in most of its state leaves, and under the first flag below in none. The recompute
# check (trainer/checks/recompute.py) needs equal bits, so main.py sets these flags when it is on.
# Under that flag alone cuDNN attention's training step failed in CUDA graph capture ("capturing
# stream has unjoined work"), so command buffers (CUDA graphs) go with it. gpu_check's recompute row
# measures their cost against XLA's default speed. Flags of yours in
# XLA_FLAGS come later and win; with --xla_gpu_deterministic_ops=false the recompute check is off on
# GPUs, and says so.
DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops"
DETERMINISTIC_GPU_FLAGS = (f"{DETERMINISTIC_FLAG}=true", "--xla_gpu_enable_command_buffer=")


def use_deterministic_gpu_ops() -> None:
  """Must run before the backend starts (XLA reads XLA_FLAGS once); known flags on every backend."""
  os.environ["XLA_FLAGS"] = " ".join((*DETERMINISTIC_GPU_FLAGS, os.environ.get("XLA_FLAGS", ""))).strip()


def gpu_ops_deterministic() -> bool:
  """Whether XLA_FLAGS leaves XLA:GPU's kernels deterministic: the last setting of the flag wins."""
  value = "false"
  for flag in os.environ.get("XLA_FLAGS", "").split():
    name, _, given = flag.partition("=")
    if name == DETERMINISTIC_FLAG:
      value = given.lower() or "true"
  return value in ("true", "1")


def use_cpu_collectives_interface(interface: str | None) -> None:
  """Gloo, XLA:CPU's collectives between processes, advertises to its peers the address this host's
  name resolves to (often 127.0.1.1, or another network's address on a multi-homed host): with an
  interface named, the address of that interface instead. Must run before the CPU backend starts.
  JAX passes no such option; jaxlib's make_gloo_tcp_collectives takes it, so its one caller in JAX
  (the CPU client's factory) gets it bound in."""
  if not interface:
    return
  import socket

  if interface not in {name for _, name in socket.if_nameindex()}:
    names = ", ".join(sorted(name for _, name in socket.if_nameindex()))
    raise UserError(f"--cpu_collectives_interface={interface}: no such network interface here ({names})")
  from jax._src import xla_bridge

  make = xla_bridge._jax.make_gloo_tcp_collectives
  xla_bridge._jax.make_gloo_tcp_collectives = lambda **kw: make(**kw, interface=interface)


def configure_cpu_devices(n: int | None) -> None:
  """N logical CPU devices; must run before anything touches jax.devices()."""
  if not n:
    return
  if n < 1:
    raise UserError(f"--cpu_devices={n}: must be at least 1")
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", n)
  os.environ["XLA_FLAGS"] = " ".join((*CPU_COLLECTIVE_FLAGS, os.environ.get("XLA_FLAGS", ""))).strip()


def _cluster_env() -> bool:
  """Whether a scheduler says this process is one of several (what jax.distributed detects)."""
  if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
    return True
  return "JAX_COORDINATOR_ADDRESS" in os.environ and "JAX_NUM_PROCESSES" in os.environ


def _seconds(given: int | None, env: str) -> int | None:
  """A timeout from the caller, else from the environment, else None (JAX's default)."""
  if given is None and os.environ.get(env):
    try:
      given = int(os.environ[env])
    except ValueError:
      raise UserError(f"{env}={os.environ[env]!r}: must be a whole number of seconds") from None
  if given is not None and given < 1:
    raise UserError(f"a distributed timeout of {given} s is too short; use at least 1 (from {env} or a flag)")
  return given


_JAX_DEFAULT_HEARTBEAT_S = 100  # jax.distributed.initialize's heartbeat_timeout_seconds.
_heartbeat_s = [_JAX_DEFAULT_HEARTBEAT_S]


def heartbeat_timeout_s() -> int:
  """Seconds after which JAX's coordination service declares a silent process dead (and aborts)."""
  return _heartbeat_s[0]


def _loopback_bind_address(coordinator: str) -> str | None:
  """HOST:PORT to bind the coordinator to when HOST is loopback, else None (JAX binds [::]:PORT).

  JAX's default binds every interface; a job whose coordinator is 127.0.0.1 has no reason to
  accept connections from other machines (invariant 8), so it listens on loopback only.
  """
  if os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
    return None  # The user chose; jax.distributed reads it.
  host = coordinator.rsplit(":", 1)[0].strip("[]")
  if host == "localhost":
    return coordinator
  try:
    return coordinator if ipaddress.ip_address(host).is_loopback else None
  except ValueError:
    return None  # A host name: it may be any machine.


def _initialize(
  coordinator, num_processes, process_id, init_timeout_s, heartbeat_timeout_s, shutdown_timeout_s
):
  kwargs = {}
  for name, given, env in (
    ("initialization_timeout", init_timeout_s, INIT_TIMEOUT_ENV),
    ("heartbeat_timeout_seconds", heartbeat_timeout_s, HEARTBEAT_TIMEOUT_ENV),
    ("shutdown_timeout_seconds", shutdown_timeout_s, SHUTDOWN_TIMEOUT_ENV),
  ):
    if (seconds := _seconds(given, env)) is not None:
      kwargs[name] = seconds
  _heartbeat_s[0] = kwargs.get("heartbeat_timeout_seconds", _JAX_DEFAULT_HEARTBEAT_S)
  if coordinator is not None and (bind := _loopback_bind_address(coordinator)):
    kwargs["coordinator_bind_address"] = bind
  # A coordinator that never answers ends the process with a fatal log from inside JAX after
  # `initialization_timeout` (exit 134), not with an exception: there is nothing here to catch.
  jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id, **kwargs)
  previous_hook = sys.excepthook

  def exit_on_uncaught(exc_type, exc, tb):
    previous_hook(exc_type, exc, tb)  # The traceback first: it is the report.
    exit_now_if_joined(130 if issubclass(exc_type, KeyboardInterrupt) else 1)

  sys.excepthook = exit_on_uncaught


_cache_hits = [0]


def _count_cache_hit(event: str, **_) -> None:
  if event == "/jax/compilation_cache/cache_hits":
    _cache_hits[0] += 1


jax.monitoring.register_event_listener(_count_cache_hit)


def compilation_cache_hits() -> int:
  """Programs this process has loaded from the persistent compilation cache so far."""
  return _cache_hits[0]


def exit_now_if_joined(code: int) -> None:
  """In a multi-process job, ends this process at once with `code`; otherwise returns.

  A normal exit runs JAX's atexit shutdown, which waits at a barrier for every process (300 s by
  default). A process that failed would wait there for peers that are blocked in a collective
  waiting for it, and the job would hang instead of ending. Leaving without exit hooks lets the
  launcher, or the peers' heartbeats, end the job. Nothing is lost that a restart needs: Orbax
  commits a checkpoint step atomically, and metrics files are flushed row by row.
  """
  if jax.distributed.is_initialized():
    sys.stdout.flush()
    sys.stderr.flush()
    _leave_last_if_coordinator()
    os._exit(code)


LEAVE_WAIT_S = 15.0
# A peer that has said it is leaving is alive until its os._exit: were process 0 (and the service) gone
# before then, JAX would abort it with a fatal log. Process 0 gives its peers this long to go.
LEAVE_GRACE_S = 2.0


def _leave_last_if_coordinator() -> None:
  """Process 0 hosts the coordination service: once it is gone, JAX aborts every other process at
  once, and a peer that was about to print its own `error:` line of a stop they all agreed on (a
  fork's hook that raised, say) never did. So each other process says it is leaving, and process 0
  waits for them, LEAVE_WAIT_S at most: peers stuck in a collective are ended as before. A loaded
  machine can take seconds to get a peer there; a dead peer costs the wait in full."""
  client = distributed.global_state.client
  if client is None or jax.process_count() == 1:
    return
  me = jax.process_index()
  try:
    if me:  # A thread: across a partition the call would hang, and this process must still leave.
      said = threading.Thread(target=client.key_value_set, args=(f"leaving/{me}", "1", True), daemon=True)
      said.start()
      said.join(timeout=1.0)
      return
    deadline = time.monotonic() + LEAVE_WAIT_S
    for peer in range(1, jax.process_count()):
      left_ms = int(1000 * (deadline - time.monotonic()))
      if left_ms <= 0:
        return
      client.blocking_key_value_get(f"leaving/{peer}", left_ms)
    time.sleep(LEAVE_GRACE_S)
  except Exception:  # noqa: BLE001 - the service's deadline or a peer already gone: leave now.
    return


def join_job(
  coordinator: str | None,
  num_processes: int | None,
  process_id: int | None,
  init_timeout_s: int | None = None,
  heartbeat_timeout_s: int | None = None,
  shutdown_timeout_s: int | None = None,
) -> None:
  """Joins a multi-process job from explicit flags or the environment; else runs alone.

  `init_timeout_s` bounds the wait for every process to connect; `heartbeat_timeout_s` is how long
  a silent peer is tolerated before the job ends; `shutdown_timeout_s` bounds the wait for the
  others at exit. None reads JAX_INIT_TIMEOUT_S / JAX_HEARTBEAT_TIMEOUT_S / JAX_SHUTDOWN_TIMEOUT_S,
  and without those JAX's defaults (300 s / 100 s / 300 s) apply. A process that joined exits at
  once on an uncaught exception (see exit_now_if_joined).
  """
  given = [coordinator is not None, num_processes is not None, process_id is not None]
  if any(given) and not all(given):
    raise UserError("--coordinator_address, --num_processes and --process_id go together")
  if all(given):
    if not 0 <= process_id < num_processes:
      raise UserError(f"--process_id={process_id} must be in [0, {num_processes})")
    _initialize(
      coordinator, num_processes, process_id, init_timeout_s, heartbeat_timeout_s, shutdown_timeout_s
    )
  elif os.environ.get("JAX_COORDINATOR_ADDRESS") and os.environ.get("JAX_NUM_PROCESSES"):
    try:
      num, pid = int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"])
    except (KeyError, ValueError):
      raise UserError(
        "JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES are set: JAX_PROCESS_ID must be set too, to an integer"
      ) from None
    _initialize(
      os.environ["JAX_COORDINATOR_ADDRESS"], num, pid, init_timeout_s, heartbeat_timeout_s, shutdown_timeout_s
    )
  elif _cluster_env():
    # SLURM / Kubernetes: JAX reads the scheduler's environment. Its SLURM detection gives each process
    # only GPU number SLURM_LOCALID: with one task per node, GPU 0 of 8. A lone task drives all it sees.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and os.environ.get("SLURM_STEP_TASKS_PER_NODE", "").split("(")[0] == "1":
      os.environ.setdefault("JAX_LOCAL_DEVICE_IDS", ",".join(map(str, range(len(visible.split(","))))))
    _initialize(None, None, None, init_timeout_s, heartbeat_timeout_s, shutdown_timeout_s)


# The cache is bounded: least recently used programs go first. Bounding it also makes JAX lock the
# folder for every read and write (filelock), so concurrent runs never read an entry half written.
COMPILATION_CACHE_MAX_BYTES = 8 << 30


def use_compilation_cache(setting: str, workdir: str) -> str | None:
  """Turns on JAX's persistent compilation cache (the `compilation_cache` key in
  trainer/config/trainer_keys.py); returns its directory, or None when off. Before the first compile:
  JAX reads the setting once per process. Every program is cached, however fast it compiled (JAX's
  default keeps only those over a second): initialization and evaluation load too."""
  if setting == "off" and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return None
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_MAX_BYTES)
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]  # JAX has read it already; the environment wins.
  if setting == "workdir":
    directory = rundir.compilation_cache(workdir)
  else:
    directory = setting or rundir.user_compilation_cache()
  directory = os.path.abspath(directory)
  jax.config.update("jax_compilation_cache_dir", directory)
  return directory
