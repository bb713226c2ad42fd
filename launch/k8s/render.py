"""Renders a Kubernetes JobSet that runs main.py on several GPU hosts, or through Pathways on TPU slices.

  python launch/k8s/render.py --image=REGISTRY/IMAGE:TAG --replicas=4 --pvc=runs \\
      --config=configs/lm_small.py --workdir=/runs/lm_small -- --config.steps=20000 > job.yaml
  kubectl apply -f job.yaml      # needs the JobSet controller (jobset.x-k8s.io) installed in the cluster

GPU (the default): one JobSet with one replicated Job of `replicas` pods, one process each, with
`gpus_per_replica` GPUs (`nvidia.com/gpu`) per pod. Pod I runs `python main.py --config=...
--workdir=... ARGS...` with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set, which
trainer/runtime.py reads to join the job; process I is the pod's Job completion index. Process 0 is
pod `<name>-worker-0-0`, reachable as `<name>-worker-0-0.<name>:PORT` through the headless Service
`<name>` (the JobSet's network subdomain). The workdir is a PersistentVolumeClaim mounted in every
pod. Any failed pod fails the Job (backoffLimit 0; a lone restarted process cannot rejoin a running
jax.distributed job) and the JobSet then recreates every pod, up to `max_restarts` times; the new
processes resume from the last checkpoint in the workdir. A process that exits 2 (main.py's `error:`
line: a mistake that a restart would repeat) fails the JobSet at once instead. A preempted run saves
and exits PREEMPTED_EXIT_CODE (set in the pod's env), so it is restarted rather than marked complete.

Pathways (`--pathways`, TPUs on GKE): one `pathways-head` pod (the user's main.py with `--pathways`,
plus the Pathways resource manager and IFRT proxy as sidecars) and `replicas` TPU slices of `worker`
pods. main.py is the single controller: one process that sees every TPU through the proxy. The shape
follows the JobSet that Google's PathwaysJob controller (github.com/google/pathways-job) builds; it is
a best effort: TPUs are not available to test here. What the tests check is the structure (every
object against the vendored schemas in launch/k8s/schema.py, the env wiring, the command); they do
not check that the Pathways images accept these flags, the TPU type tables, or that a cluster runs it.
Fields marked UNVERIFIED below are the ones to check against the current GKE Pathways docs.

Cluster requirements: the JobSet controller (failurePolicy.rules and, for --pathways, spec.coordinator
need a recent release; v0.8 or later has both), Kubernetes >= 1.26 for the Job's podFailurePolicy and
>= 1.29 for the sidecar containers of --pathways.
"""

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from types import SimpleNamespace

if __package__ in (None, ""):  # Run as a script (python launch/k8s/render.py): import from the repository.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from launch.k8s import schema  # noqa: E402

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
WORKER_JOB = "worker"
CONTAINER = "trainer"
# JAX's own Kubernetes auto-detection (jax/_src/clusters/k8s_cluster.py) uses this port; the same one
# here means nothing surprises someone who knows that path.
COORDINATOR_PORT = 55527
# main.py exits 2 after an `error:` line: bad flags or config, which the next attempt would repeat.
USER_ERROR_EXIT = 2
# A run stopped by SIGTERM (preemption) saves and, by default, exits 0: every pod exiting 0 would mark the
# Job, and the JobSet, "Completed" with steps left. With PREEMPTED_EXIT_CODE set, trainer/run.py exits
# with that code instead: a failure, which the JobSet answers by restarting every pod, and they resume
# from the checkpoint just saved.
PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, the shell's convention.
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# Flags the manifest sets itself; given after `--` they would contradict it.
RESERVED_FLAGS = (
  "--config",
  "--workdir",
  "--coordinator_address",
  "--num_processes",
  "--process_id",
  "--pathways",
)

# --- Pathways (UNVERIFIED: values from google/pathways-job's controller, not run here).
PATHWAYS_HEAD_JOB = "pathways-head"
# The server image runs both the resource manager and the workers.
PATHWAYS_SERVER_IMAGE = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/server"
PATHWAYS_PROXY_IMAGE = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/proxy_server"
# Older GKE docs used 29008 for the proxy; the number is only a flag shared by the proxy and the client.
PATHWAYS_PROXY_PORT = 29000
PATHWAYS_RM_PORT = 29001
PATHWAYS_WORKER_PORT = 29005
# JobSet writes the coordinator pod's DNS name (<name>-pathways-head-0-0.<subdomain>) into this label of
# every pod when spec.coordinator is set (JobSet >= v0.8).
COORDINATOR_LABEL = "metadata.labels['jobset.sigs.k8s.io/coordinator']"
# TPU generation -> (GKE node label cloud.google.com/gke-tpu-accelerator, Pathways instance type prefix,
# topology dimensions). Four chips per host for all of them (the ct*-4t machine types).
TPUS = {
  "v4": ("tpu-v4-podslice", "tpuv4", 3),
  "v5e": ("tpu-v5-lite-podslice", "tpuv5e", 2),
  "v5p": ("tpu-v5p-slice", "tpuv5", 3),
  "v6e": ("tpu-v6e-slice", "tpuv6e", 2),
}
TPU_CHIPS_PER_HOST = 4


class RenderError(ValueError):
  """Input the manifest cannot be made from; the message says what to change."""


def _env(name: str, value: str | None = None, field: str | None = None) -> dict:
  if field is not None:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field}}}
  return {"name": name, "value": value}


def _check_dns_label(what: str, value: str) -> None:
  if not isinstance(value, str) or not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", value) or len(value) > 63:
    raise RenderError(
      f"{what}={value!r}: must be lower-case letters, digits and '-', start with a letter, "
      "at most 63 characters"
    )


def _check_inputs(image, command_args, config, workdir, replicas, name, namespace, pvc, mount_path) -> None:
  if not isinstance(image, str) or not image.strip():
    raise RenderError(
      "image is empty: give the container image that holds this repository, e.g. REGISTRY/IMAGE:TAG"
    )
  if any(c.isspace() for c in image):
    raise RenderError(f"image={image!r} contains whitespace")
  if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
    raise RenderError(f"replicas={replicas!r}: must be a whole number of at least 1")
  if not config:
    raise RenderError("config is empty: give the config file main.py should read, e.g. configs/lm_small.py")
  if not workdir:
    raise RenderError("workdir is empty: give the run directory every pod shares, e.g. /runs/NAME")
  _check_dns_label("name", name)
  _check_dns_label("namespace", namespace)
  if isinstance(command_args, str):
    raise RenderError(f"command_args must be a list of flags, not the string {command_args!r}")
  for arg in command_args:
    if not isinstance(arg, str):
      raise RenderError(f"command_args: {arg!r} is not a string")
    if arg.split("=", 1)[0] in RESERVED_FLAGS:
      raise RenderError(f"{arg.split('=', 1)[0]} is set by the manifest; remove it from the extra arguments")
  if "://" in workdir:
    return  # A URL (e.g. gs://...): nothing to mount, if the trainer can write there.
  if pvc is None:
    raise RenderError(
      f"workdir={workdir!r} is a path: give pvc=CLAIM, a PersistentVolumeClaim that every pod mounts at "
      f"{mount_path}, so checkpoints outlive the pods (a restart resumes from them)"
    )
  if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", pvc) or len(pvc) > 253:
    raise RenderError(f"pvc={pvc!r}: not a valid claim name (lower-case letters, digits, '-' and '.')")
  if not mount_path.startswith("/") or not workdir.startswith("/"):
    what, value = ("mount_path", mount_path) if not mount_path.startswith("/") else ("workdir", workdir)
    raise RenderError(
      f"{what}={value!r}: must be an absolute path (the pod's working directory is the image's)"
    )
  mount = os.path.normpath(mount_path)
  if os.path.commonpath([os.path.normpath(workdir), mount]) != mount:
    raise RenderError(
      f"workdir={workdir!r} is outside the volume mounted at {mount_path}; use a path under it"
    )


def _check_hostname(name: str, job: str, jobs: int, pods: int) -> None:
  # Pod host names are <jobset>-<job>-<job index>-<pod index> and must fit a 63-character DNS label.
  longest = f"{name}-{job}-{jobs - 1}-{pods - 1}"
  if len(longest) > 63:
    raise RenderError(f"name={name!r} is too long: pod host name {longest!r} exceeds 63 characters")


def _volumes(workdir: str, pvc: str | None, mount_path: str, shm_size: str | None) -> tuple[list, list]:
  """(volumes, volumeMounts): the shared workdir, and a larger /dev/shm."""
  volumes, mounts = [], []
  if pvc is not None:
    volumes.append({"name": "workdir", "persistentVolumeClaim": {"claimName": pvc}})
    mounts.append({"name": "workdir", "mountPath": mount_path})
  if shm_size:
    # A container's /dev/shm is 64 MiB by default; NCCL and Grain's worker processes use shared memory.
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}})
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
  return volumes, mounts


def _user_error_policies(container: str, target_job: str) -> tuple[dict, dict]:
  """(Job podFailurePolicy, JobSet failurePolicy rule): an `error:` exit ends the JobSet, not a restart.

  The Job's failure reason is PodFailurePolicy only when this rule matched; other failures (a crash, a
  lost node, a peer that timed out) keep JobSet's default action, RestartJobSet.
  """
  pod_failure_policy = {
    "rules": [
      {
        "action": "FailJob",
        "onExitCodes": {"containerName": container, "operator": "In", "values": [USER_ERROR_EXIT]},
      }
    ]
  }
  rule = {
    "name": "UserErrorFailsJobSet",
    "action": "FailJobSet",
    "onJobFailureReasons": ["PodFailurePolicy"],
    "targetReplicatedJobs": [target_job],
  }
  return pod_failure_policy, rule


def _gpu_objects(o: SimpleNamespace) -> list[dict]:
  _check_hostname(o.name, WORKER_JOB, 1, o.replicas)
  coordinator = f"{o.name}-{WORKER_JOB}-0-0.{o.name}:{o.port}"
  volumes, mounts = _volumes(o.workdir, o.pvc, o.mount_path, o.shm_size)
  container = {
    "name": CONTAINER,
    "image": o.image,
    "workingDir": o.working_dir,
    "command": ["python", "main.py"],
    "args": o.args,
    "env": [
      # trainer/runtime.py joins the job from these three (jax.distributed.initialize with them).
      _env("JAX_COORDINATOR_ADDRESS", coordinator),
      _env("JAX_NUM_PROCESSES", str(o.replicas)),
      _env("JAX_PROCESS_ID", field=COMPLETION_INDEX),
      _env("PYTHONUNBUFFERED", "1"),  # Lines reach `kubectl logs` as they are printed.
      _env("PREEMPTED_EXIT_CODE", str(PREEMPTED_EXIT_CODE)),
      *(_env(k, v) for k, v in o.env.items()),
    ],
    "ports": [{"name": "coordinator", "containerPort": o.port}],
    # An extended resource: the request defaults to the limit; GKE adds the GPU-node toleration itself.
    **({"resources": {"limits": {"nvidia.com/gpu": o.gpus_per_replica}}} if o.gpus_per_replica else {}),
    "volumeMounts": mounts,
  }
  pod = {
    # Never: a process restarted in place could not rejoin; the Job fails and the JobSet restarts all.
    "restartPolicy": "Never",
    "subdomain": o.name,  # JobSet sets it from spec.network too; written here so the manifest says it.
    # SIGTERM (preemption, `kubectl delete`) makes the trainer agree on a step, save and exit.
    "terminationGracePeriodSeconds": o.termination_grace_s,
    "containers": [container],
    "volumes": volumes,
  }
  if o.node_selector:
    pod["nodeSelector"] = dict(o.node_selector)
  pod_failure_policy, user_error_rule = _user_error_policies(CONTAINER, WORKER_JOB)
  jobset = {
    "apiVersion": JOBSET_API,
    "kind": "JobSet",
    "metadata": {"name": o.name, "namespace": o.namespace},
    "spec": {
      # Pods get DNS names <name>-worker-0-I.<name>, published before they are ready: process 0 must
      # be reachable while every process is still starting.
      "network": {"enableDNSHostnames": True, "subdomain": o.name, "publishNotReadyAddresses": True},
      "failurePolicy": {"maxRestarts": o.max_restarts, "rules": [user_error_rule]},
      "replicatedJobs": [
        {
          "name": WORKER_JOB,
          "replicas": 1,  # One Job; its pods are the processes.
          "template": {
            "spec": {
              "parallelism": o.replicas,  # All processes run at once: jax.distributed waits for every one.
              "completions": o.replicas,
              "completionMode": "Indexed",  # Pod I gets completion index I: its process id.
              "backoffLimit": 0,
              "podFailurePolicy": pod_failure_policy,
              "template": {"spec": pod},
            }
          },
        }
      ],
    },
  }
  objects = [jobset]
  if o.service:
    # The JobSet controller creates this headless Service itself when it is missing; rendering it keeps
    # the coordinator's DNS name visible in the manifest and works with JobSet versions that do not.
    objects.insert(0, _headless_service(o.name, o.namespace, o.port))
  return objects


def _headless_service(name: str, namespace: str, port: int) -> dict:
  return {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": name, "namespace": namespace},
    "spec": {
      "clusterIP": "None",
      "publishNotReadyAddresses": True,
      "selector": {"jobset.sigs.k8s.io/jobset-name": name},
      "ports": [{"name": "coordinator", "port": port}],
    },
  }


def _tpu_slice(tpu: str, topology: str) -> tuple[str, str, int, int]:
  """(GKE accelerator label, Pathways instance type, hosts per slice, chips per host)."""
  if tpu not in TPUS:
    raise RenderError(f"tpu={tpu!r}: must be one of {', '.join(TPUS)}")
  accelerator, prefix, dims = TPUS[tpu]
  if not re.fullmatch(r"\d+(x\d+)*", topology or "") or topology.count("x") + 1 != dims:
    example = "4x4" if dims == 2 else "2x2x2"
    raise RenderError(f"topology={topology!r}: TPU {tpu} takes {dims} dimensions, e.g. {example}")
  chips = math.prod(int(d) for d in topology.split("x"))
  if chips < 1:
    raise RenderError(f"topology={topology!r}: every dimension must be at least 1")
  hosts = max(1, chips // TPU_CHIPS_PER_HOST)
  return accelerator, f"{prefix}:{topology}", hosts, min(chips, TPU_CHIPS_PER_HOST)


def _pathways_objects(o: SimpleNamespace) -> list[dict]:
  if not o.gcs_scratch or not o.gcs_scratch.startswith("gs://"):
    raise RenderError(
      f"gcs_scratch={o.gcs_scratch!r}: Pathways needs a gs://BUCKET/PATH for its temporary files"
    )
  accelerator, instance_type, hosts, chips_per_host = _tpu_slice(o.tpu, o.topology)
  _check_hostname(o.name, PATHWAYS_HEAD_JOB, 1, 1)
  _check_hostname(o.name, WORKER_JOB, o.replicas, hosts)
  server_image = f"{PATHWAYS_SERVER_IMAGE}:{o.pathways_version}"
  head_address = lambda: _env("PATHWAYS_HEAD", field=COORDINATOR_LABEL)  # A fresh dict each use.
  volumes, mounts = _volumes(o.workdir, o.pvc, o.mount_path, o.shm_size)

  # The resource manager and the proxy are native sidecars (init containers with restartPolicy Always,
  # Kubernetes >= 1.29): they start first, run beside main.py, and do not keep the pod alive when it
  # exits, so the head Job completes when training does.
  resource_manager = {
    "name": "pathways-rm",
    "image": server_image,
    "restartPolicy": "Always",
    "args": [
      f"--server_port={PATHWAYS_RM_PORT}",
      f"--gcs_scratch_location={o.gcs_scratch}",
      "--node_type=resource_manager",
      f"--instance_count={o.replicas}",  # TPU slices.
      f"--instance_type={instance_type}",  # UNVERIFIED: e.g. tpuv5e:4x4; check the GKE docs for yours.
    ],
    "env": [
      _env("REPLICATED_JOB_NAME", field="metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']"),
      _env("JOBSET_NAME", field="metadata.annotations['jobset.sigs.k8s.io/jobset-name']"),
      _env("HOST_ADDRESS", field=COORDINATOR_LABEL),
      _env("TPU_SKIP_MDS_QUERY", "true"),  # Not on a TPU VM: no TPU metadata server to ask.
    ],
    "ports": [{"containerPort": PATHWAYS_RM_PORT}, {"containerPort": PATHWAYS_RM_PORT + 1}],
    "resources": {"limits": {"cpu": "8", "memory": "16G"}},  # UNVERIFIED sizes, from pathways-job.
  }
  proxy = {
    "name": "pathways-proxy",
    "image": f"{PATHWAYS_PROXY_IMAGE}:{o.pathways_version}",
    "restartPolicy": "Always",
    "args": [
      f"--server_port={PATHWAYS_PROXY_PORT}",
      f"--resource_manager_address=$(PATHWAYS_HEAD):{PATHWAYS_RM_PORT}",
      f"--gcs_scratch_location={o.gcs_scratch}",
    ],
    "env": [head_address()],
    "ports": [{"containerPort": PATHWAYS_PROXY_PORT}],
    "resources": {"limits": {"cpu": "16", "memory": "100G"}},  # UNVERIFIED sizes, from pathways-job.
  }
  trainer = {
    "name": CONTAINER,
    "image": o.image,
    "workingDir": o.working_dir,
    "command": ["python", "main.py"],
    "args": o.args,
    "env": [
      head_address(),
      # The JAX client talks to the proxy; trainer/pathways.py and pathwaysutils key on "proxy".
      _env("JAX_PLATFORMS", "proxy"),
      _env("JAX_BACKEND_TARGET", f"grpc://$(PATHWAYS_HEAD):{PATHWAYS_PROXY_PORT}"),
      _env("XCLOUD_ENVIRONMENT", "GCP"),  # UNVERIFIED: set by pathways-job for the client.
      _env("PYTHONUNBUFFERED", "1"),
      _env("PREEMPTED_EXIT_CODE", str(PREEMPTED_EXIT_CODE)),  # The head Job must fail, not complete.
      *(_env(k, v) for k, v in o.env.items()),
    ],
    "volumeMounts": mounts,
  }
  head_pod = {
    "restartPolicy": "Never",
    "terminationGracePeriodSeconds": o.termination_grace_s,
    # Host networking, as pathways-job sets for the head and the workers (its comment: for performance).
    "hostNetwork": True,
    "dnsPolicy": "ClusterFirstWithHostNet",  # Cluster DNS names still resolve with host networking.
    "initContainers": [resource_manager, proxy],
    "containers": [trainer],
    "volumes": volumes,
  }
  if o.node_selector:
    head_pod["nodeSelector"] = dict(o.node_selector)  # E.g. the CPU node pool for the head.

  worker_pod = {
    "restartPolicy": "Never",
    "terminationGracePeriodSeconds": o.termination_grace_s,
    "hostNetwork": True,
    "dnsPolicy": "ClusterFirstWithHostNet",
    "nodeSelector": {
      "cloud.google.com/gke-tpu-accelerator": accelerator,
      "cloud.google.com/gke-tpu-topology": o.topology,
    },
    "containers": [
      {
        "name": "pathways-worker",
        "image": server_image,
        "args": [
          f"--server_port={PATHWAYS_WORKER_PORT}",
          f"--resource_manager_address=$(PATHWAYS_HEAD):{PATHWAYS_RM_PORT}",
          f"--gcs_scratch_location={o.gcs_scratch}",
        ],
        "env": [
          head_address(),
          # UNVERIFIED: multislice wiring as pathways-job sets it.
          _env("MEGASCALE_COORDINATOR_ADDRESS", field=COORDINATOR_LABEL),
          _env("MEGASCALE_NUM_SLICES", field="metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']"),
          _env("MEGASCALE_SLICE_ID", field="metadata.labels['jobset.sigs.k8s.io/job-index']"),
          _env("JOBSET_NAME", field="metadata.annotations['jobset.sigs.k8s.io/jobset-name']"),
          _env("REPLICATED_JOB_NAME", field="metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']"),
          _env("XCLOUD_ENVIRONMENT", "GCP"),
        ],
        "ports": [
          {"containerPort": PATHWAYS_WORKER_PORT},
          {"containerPort": PATHWAYS_WORKER_PORT + 1},
          {"containerPort": 8471},  # TPU runtime (UNVERIFIED: listed by pathways-job).
          {"containerPort": 8080},
        ],
        "resources": {"limits": {"google.com/tpu": chips_per_host}},
        "volumeMounts": [{"name": "shared-tmp", "mountPath": "/tmp"}],
      }
    ],
    "volumes": [{"name": "shared-tmp", "hostPath": {"path": "/tmp", "type": "DirectoryOrCreate"}}],
  }
  pod_failure_policy, user_error_rule = _user_error_policies(CONTAINER, PATHWAYS_HEAD_JOB)
  jobset = {
    "apiVersion": JOBSET_API,
    "kind": "JobSet",
    "metadata": {"name": o.name, "namespace": o.namespace},
    "spec": {
      "network": {"enableDNSHostnames": True, "subdomain": o.name, "publishNotReadyAddresses": True},
      # Every pod learns the head's DNS name from the jobset.sigs.k8s.io/coordinator label (JobSet >= v0.8).
      "coordinator": {"replicatedJob": PATHWAYS_HEAD_JOB, "jobIndex": 0, "podIndex": 0},
      "startupPolicy": {"startupPolicyOrder": "InOrder"},  # The head (resource manager) before the workers.
      # Workers serve until deleted: training is done when the head's main.py is.
      "successPolicy": {"operator": "All", "targetReplicatedJobs": [PATHWAYS_HEAD_JOB]},
      "failurePolicy": {"maxRestarts": o.max_restarts, "rules": [user_error_rule]},
      "replicatedJobs": [
        {
          "name": PATHWAYS_HEAD_JOB,
          "replicas": 1,
          "template": {
            # The head alone on its node (UNVERIFIED: pathways-job's default deployment mode).
            "metadata": {
              "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "kubernetes.io/hostname"}
            },
            "spec": {
              "parallelism": 1,
              "completions": 1,
              "completionMode": "Indexed",
              "backoffLimit": 0,
              "podFailurePolicy": pod_failure_policy,
              "template": {"spec": head_pod},
            },
          },
        },
        {
          "name": WORKER_JOB,
          "replicas": o.replicas,  # One Job per TPU slice, each slice on its own node pool.
          "template": {
            "metadata": {
              "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
            },
            "spec": {
              "parallelism": hosts,
              "completions": hosts,
              "completionMode": "Indexed",
              # UNVERIFIED: pathways-job allows 4 restarts per host; the resource manager takes a
              # restarted worker back, so a worker failure need not restart the whole JobSet.
              "backoffLimit": 4 * hosts,
              "template": {"spec": worker_pod},
            },
          },
        },
      ],
    },
  }
  return [jobset]


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
  node_selector: Mapping[str, str] | None = None,
  env: Mapping[str, str] | None = None,
  service: bool = True,
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
  port: the jax.distributed coordinator port on process 0 (GPU).
  max_restarts: JobSet restarts (every pod recreated, training resumes from its checkpoint) before
    the JobSet is marked failed. Preemptions count too.
  termination_grace_s: seconds between SIGTERM and SIGKILL, for the trainer's save on preemption.
  shm_size: size of /dev/shm (memory-backed); None keeps the container default (64 MiB).
  node_selector: GPU: for the worker pods; Pathways: for the head pod (e.g. a CPU node pool).
  env: extra environment variables for main.py's container.
  service: also render the headless Service (GPU); the JobSet controller otherwise creates it.

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
    if not 1 <= port <= 65535:
      raise RenderError(f"port={port}: must be in [1, 65535]")
    o.args = main_args
    objects = _gpu_objects(o)
  # The vendored schemas catch what the checks above do not (an env name the API rejects, a bad
  # quantity): better here, with the field's path, than from the API server after `kubectl apply`.
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
  parser.add_argument("--node_selector", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra env for main.py")
  parser.add_argument("--no_service", action="store_true", help="leave the headless Service to JobSet")
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
      node_selector=node_selector,
      env=env,
      service=not args.no_service,
      tpu=args.tpu,
      topology=args.topology,
      gcs_scratch=args.gcs_scratch,
      pathways_version=args.pathways_version,
    )
  except RenderError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
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
