"""Renders a Kubernetes JobSet that runs main.py on several GPU hosts, or through Pathways on TPU slices.

  python launch/k8s/render.py --image=REGISTRY/IMAGE:TAG --replicas=4 --pvc=runs \\
      --config=configs/lm_125m.py --workdir=/runs/lm_125m -- --config.steps=20000 > job.yaml
  kubectl apply -f job.yaml      # needs the JobSet controller (jobset.x-k8s.io) installed in the cluster

GPU (the default): one JobSet with one replicated Job of `replicas` pods, one process each, with
`gpus_per_replica` GPUs (`nvidia.com/gpu`) per pod. Pod I runs `python main.py --config=...
--workdir=... ARGS...` with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set, which
trainer/cluster/runtime.py reads to join the job; process I is the pod's Job completion index. Process 0
is pod `<name>-worker-0-0`, reachable as `<name>-worker-0-0.<name>:PORT` through the headless Service
`<name>` (the JobSet's network subdomain); process I's peer service (the link probes between every pair
of processes, trainer/cluster/peers.py) listens on PORT + 1 + I, and the NetworkPolicy admits those
ports and the coordinator's from the job's own pods only; the peer services also refuse any caller without the
job's secret, a Secret `<name>-peer` made anew per rendering and mounted in every pod. The workdir is a
PersistentVolumeClaim mounted in every pod, and holds the compilation cache every run on it shares
(MOUNT/.compilation_cache: a
pod's home dies with the pod). Any failed pod fails the Job (backoffLimit 0; a lone restarted process
cannot rejoin a running jax.distributed job) and the JobSet then recreates every pod, up to
`max_restarts` times; the new processes resume from the last checkpoint in the workdir. A process
whose exit a restart would repeat (exit_codes.py: a user error, a device that computed
wrong, out of memory, a miscompiled step) fails the JobSet at once instead. A preempted run saves and
exits PREEMPTED_EXIT_CODE (set in the pod's env), so it is restarted rather than marked complete.

Pathways (`--pathways`, TPUs on GKE): one `pathways-head` pod running main.py as the single controller,
and `replicas` TPU slices of `worker` pods; launch/k8s/pathways_jobset.py builds it and says more.
launch/k8s/gpu_jobset.py builds the GPU variant; the input checks and pod pieces both share are in
launch/k8s/common.py. Every object is validated before it is written (launch/k8s/schema.py).

Cluster requirements: the JobSet controller (failurePolicy.rules and, for --pathways, spec.coordinator
need a recent release; v0.8 or later has both), Kubernetes >= 1.26 for the Job's podFailurePolicy and
>= 1.29 for the sidecar containers of --pathways.
"""

import argparse
import json
import os
import posixpath
import sys
from collections.abc import Mapping, Sequence
from types import SimpleNamespace

if __package__ in (None, ""):  # Run as a script (python launch/k8s/render.py): import from the repository.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from launch.k8s import schema  # noqa: E402

# RESERVED_FLAGS, the GPU and the Pathways builders' names are used beside this file,
# not here; they stay importable as render.NAME, as before the splits (hence F401).
from launch.k8s.common import (  # noqa: E402, F401
  CONTAINER,
  JOBSET_API,
  PREEMPTED_EXIT_CODE,
  RESERVED_FLAGS,
  USER_ERROR_EXIT,
  WORKER_JOB,
  RenderError,
  _check_hostname,
  _check_inputs,
  _env,
  _main_container,
  _user_error_policies,
  _volumes,
)
from launch.k8s.gpu_jobset import (  # noqa: E402, F401
  COMPLETION_INDEX,
  COORDINATOR_PORT,
  LOCAL_TIER_MOUNT,
  _coordinator_policy,
  _gpu_objects,
  _headless_service,
)
from launch.k8s.pathways_jobset import (  # noqa: E402, F401
  COORDINATOR_LABEL,
  PATHWAYS_HEAD_JOB,
  PATHWAYS_PROXY_IMAGE,
  PATHWAYS_PROXY_PORT,
  PATHWAYS_RM_PORT,
  PATHWAYS_SERVER_IMAGE,
  PATHWAYS_WORKER_PORT,
  TPU_CHIPS_PER_HOST,
  TPUS,
  _pathways_objects,
)

COMPILATION_CACHE = ".compilation_cache"  # Under the claim's mount: main.py's compilation_cache.


def render(
  image: str,
  command_args: Sequence[str],
  config: str,
  workdir: str,
  replicas: int,
  gpus_per_replica: int = 8,
  name: str = "train",
  namespace: str = "default",
  pathways: bool = False,
  *,
  pvc: str | None = None,
  mount_path: str = "/runs",
  working_dir: str = "/app",
  port: int = COORDINATOR_PORT,
  max_restarts: int = 10,
  termination_grace_s: int = 120,
  shm_size: str | None = "16Gi",
  local_tier_host_path: str | None = "/dev/shm/jax-template",
  node_selector: Mapping[str, str] | None = None,
  env: Mapping[str, str] | None = None,
  service: bool = True,
  network_policy: bool = True,
  tpu: str = "v5e",
  topology: str = "4x4",
  gcs_scratch: str | None = None,
  pathways_version: str = "latest",
) -> list[dict]:
  """The Kubernetes objects (plain dicts, in `kubectl apply` order) that run main.py on a cluster.

  image: container image with this repository at `working_dir` and its dependencies installed.
  command_args: extra main.py flags (e.g. --config.steps=1000), after --config and --workdir.
  config, workdir: main.py's --config and --workdir; a path workdir must lie under `mount_path`, where
    the PersistentVolumeClaim `pvc` is mounted in every pod (a gs:// workdir needs no claim).
  replicas: GPU: pods, one process each. Pathways: TPU slices (hosts per slice follow from `topology`).
  gpus_per_replica: nvidia.com/gpu per pod; 0 for CPU-only pods. Not used with `pathways`.
  name, namespace: of the JobSet and its headless Service; pod host names start with `name`.
  pathways: render the Pathways-on-GKE variant (see the module docstring) with `tpu`, `topology`,
    `gcs_scratch` (gs:// scratch space for Pathways) and `pathways_version` (image tag).
  port: the jax.distributed coordinator port on process 0 (GPU); process I's peer service
    (trainer/cluster/peers.py) listens on port + 1 + I (PEER_PORT_BASE in the pod's env).
  max_restarts: JobSet restarts (every pod recreated, training resumes from its checkpoint) before
    the JobSet is marked failed. Preemptions count too.
  termination_grace_s: seconds between SIGTERM and SIGKILL, for the trainer's save on preemption.
  shm_size: size of /dev/shm (memory-backed); None keeps the container default (64 MiB).
  local_tier_host_path: GPU: the node's folder (a hostPath, memory-backed under /dev/shm) where the local
    checkpoint tier keeps its copies, as checkpoint.local_dir=/local-tier: a pod's own emptyDir dies
    with the pod, and a JobSet restart recreates every pod. The node's /dev/shm must hold what the
    run's `local tier:` line says. None: the config's local_dir, inside the pod.
  node_selector: GPU: for the worker pods; Pathways: for the head pod (e.g. a CPU node pool).
  env: extra environment variables for main.py's container.
  service: also render the headless Service (GPU); the JobSet controller otherwise creates it.
  network_policy: also render a NetworkPolicy that admits the coordinator port and the peer ports only
    from the job's own pods (GPU).

  Raises RenderError with a message that says what to change.
  """
  o = SimpleNamespace(**locals())  # Every argument, by name, for the builders below.
  _check_inputs(image, command_args, config, workdir, replicas, name, namespace, pvc, mount_path)
  for what, value in (("max_restarts", max_restarts), ("termination_grace_s", termination_grace_s)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise RenderError(f"{what}={value!r}: must be a whole number of at least 0")
  o.env = dict(env or {})
  for key, value in o.env.items():
    if not isinstance(value, str):
      raise RenderError(f"env {key}={value!r}: Kubernetes takes environment values as strings; quote it")
  cpu_devices = any(a.split("=", 1)[0] == "--cpu_devices" for a in command_args)
  main_args = [f"--config={config}", f"--workdir={workdir}", *command_args]
  if pathways:
    if cpu_devices:
      raise RenderError("--cpu_devices and pathways do not go together: Pathways runs on the TPU workers")
    o.args = ["--pathways", *main_args]
    objects = _pathways_objects(o)
  else:
    if isinstance(gpus_per_replica, bool) or not isinstance(gpus_per_replica, int) or gpus_per_replica < 0:
      raise RenderError(f"gpus_per_replica={gpus_per_replica!r}: must be a whole number, 0 for CPU-only pods")
    if cpu_devices and gpus_per_replica:
      raise RenderError(
        f"--cpu_devices runs on logical CPU devices: the {gpus_per_replica} GPUs per pod would sit idle; "
        "use gpus_per_replica=0 or drop --cpu_devices"
      )
    if not 1 <= port <= 65535 - replicas:
      raise RenderError(
        f"port={port}: must be in [1, {65535 - replicas}]: the {replicas} processes' peer services listen "
        "on the ports right above it (trainer/cluster/peers.py)"
      )
    cache_given = any(a.startswith("--config.compilation_cache=") for a in command_args)
    if pvc and not cache_given:  # A pod's home dies with the pod: the claim keeps the programs for all runs.
      main_args.append(f"--config.compilation_cache={posixpath.join(mount_path, COMPILATION_CACHE)}")
    local_dir_given = any(a.startswith("--config.checkpoint.local_dir=") for a in command_args)
    if local_tier_host_path and not local_dir_given:
      main_args.append(f"--config.checkpoint.local_dir={LOCAL_TIER_MOUNT}")
    else:
      o.local_tier_host_path = None
    o.args = main_args
    objects = _gpu_objects(o)
  # The schemas and the API server's rules (launch/k8s/schema.py) catch what the checks above do not (an
  # unknown field, an env name the API rejects, a bad quantity): better here, with the field's path,
  # than from the API server after `kubectl apply`.
  errors = [e for o in objects for e in schema.validate_object(o)]
  if errors:
    raise RenderError("the manifest would be invalid: " + "; ".join(errors))
  return objects


def to_json(objects: list[dict]) -> str:
  """One `kind: List` document: `kubectl apply -f` takes it, and JSON is YAML too."""
  return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2) + "\n"


def to_yaml(objects: list[dict]) -> str:
  """Multi-document YAML; JSON (to_json) where PyYAML is not installed."""
  try:
    import yaml
  except ImportError:
    return to_json(objects)

  class Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data):
      return True  # A dict that appears twice is written twice, not as an &anchor and *alias.

  return yaml.dump_all(objects, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=1000)


def _key_values(pairs: list[str], flag: str) -> dict[str, str]:
  out = {}
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep or not key:
      raise RenderError(f"{flag}={pair!r}: must be KEY=VALUE")
    out[key] = value
  return out


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="launch/k8s/render.py",
    description="Write a JobSet manifest that runs main.py on Kubernetes (GPU, or Pathways on TPU).",
    usage="%(prog)s --image=IMAGE --replicas=N --config=FILE --workdir=DIR [--pvc=CLAIM] [options] "
    "[-- MAIN_FLAGS...]",
  )
  parser.add_argument("--image", required=True, help="container image holding this repository")
  parser.add_argument(
    "--replicas", type=int, required=True, help="GPU: pods (processes); --pathways: TPU slices"
  )
  parser.add_argument("--config", required=True, help="main.py --config, relative to --working_dir")
  parser.add_argument("--workdir", required=True, help="main.py --workdir, under --mount_path (or gs://...)")
  parser.add_argument("--pvc", default=None, help="PersistentVolumeClaim holding the workdir")
  parser.add_argument("--mount_path", default="/runs", help="where the claim is mounted")
  parser.add_argument("--working_dir", default="/app", help="the repository's path inside the image")
  parser.add_argument("--gpus_per_replica", type=int, default=8, help="nvidia.com/gpu per pod; 0: CPU only")
  parser.add_argument("--name", default="train", help="JobSet name; prefixes pod host names")
  parser.add_argument("--namespace", default="default")
  parser.add_argument("--port", type=int, default=COORDINATOR_PORT, help="jax.distributed coordinator port")
  parser.add_argument("--max_restarts", type=int, default=10, help="JobSet restarts before it fails")
  parser.add_argument("--termination_grace_s", type=int, default=120, help="SIGTERM-to-SIGKILL seconds")
  parser.add_argument("--shm_size", default="16Gi", help="/dev/shm size; empty keeps the default")
  parser.add_argument(
    "--local_tier_host_path",
    default="/dev/shm/jax-template",
    help="GPU: the node folder of the local checkpoint tier (survives pod restarts); empty: inside the pod",
  )
  parser.add_argument("--node_selector", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra env for main.py")
  parser.add_argument("--no_service", action="store_true", help="leave the headless Service to JobSet")
  parser.add_argument(
    "--no_network_policy",
    action="store_true",
    help="no NetworkPolicy guarding the coordinator and peer ports",
  )
  parser.add_argument("--pathways", action="store_true", help="Pathways on GKE TPUs (best effort, untested)")
  parser.add_argument("--tpu", default="v5e", choices=sorted(TPUS), help="--pathways: TPU generation")
  parser.add_argument("--topology", default="4x4", help="--pathways: slice topology, e.g. 4x4 or 2x2x2")
  parser.add_argument("--gcs_scratch", default=None, help="--pathways: gs://BUCKET/PATH for Pathways")
  parser.add_argument("--pathways_version", default="latest", help="--pathways: image tag")
  parser.add_argument("--format", choices=["yaml", "json"], default="yaml", help="yaml falls back to json")
  parser.add_argument("--output", "-o", default="-", help="file to write; '-' is stdout")
  if "--" in argv:
    cut = argv.index("--")
    own, main_flags = argv[:cut], argv[cut + 1 :]
  else:
    own, main_flags = argv, []
  args = parser.parse_args(own)
  args.main_flags = main_flags
  return args


def main(argv: list[str]) -> int:
  args = parse_args(argv)
  try:
    node_selector = _key_values(args.node_selector, "--node_selector")
    env = _key_values(args.env, "--env")
    objects = render(
      args.image,
      args.main_flags,
      args.config,
      args.workdir,
      args.replicas,
      gpus_per_replica=args.gpus_per_replica,
      name=args.name,
      namespace=args.namespace,
      pathways=args.pathways,
      pvc=args.pvc,
      mount_path=args.mount_path,
      working_dir=args.working_dir,
      port=args.port,
      max_restarts=args.max_restarts,
      termination_grace_s=args.termination_grace_s,
      shm_size=args.shm_size or None,
      local_tier_host_path=args.local_tier_host_path or None,
      node_selector=node_selector,
      env=env,
      service=not args.no_service,
      network_policy=not args.no_network_policy,
      tpu=args.tpu,
      topology=args.topology,
      gcs_scratch=args.gcs_scratch,
      pathways_version=args.pathways_version,
    )
  except RenderError as e:
    print(f"error: {e}", file=sys.stderr)
    return USER_ERROR_EXIT
  text = to_json(objects) if args.format == "json" else to_yaml(objects)
  if args.output == "-":
    sys.stdout.write(text)
  else:
    with open(args.output, "w") as f:
      f.write(text)
    print(
      f"wrote {args.output}: {', '.join(o['kind'] + '/' + o['metadata']['name'] for o in objects)}",
      file=sys.stderr,
    )
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
