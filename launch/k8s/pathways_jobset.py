"""Builds the Pathways-on-GKE variant of the JobSet (launch/k8s/render.py --pathways): TPU slices on GKE.

Pathways (`--pathways`, TPUs on GKE): one `pathways-head` pod (the user's main.py with `--pathways`,
plus the Pathways resource manager and IFRT proxy as sidecars) and `replicas` TPU slices of `worker`
pods. main.py is the single controller: one process that sees every TPU through the proxy. The shape
follows the JobSet that Google's PathwaysJob controller (github.com/google/pathways-job) builds; it is
a best effort: TPUs are not available to test here. What the tests check is the structure (every
object against the schemas and rules of launch/k8s/schema.py, the env wiring, the command); they do
not check that the Pathways images accept these flags, the TPU type tables, or that a cluster runs it.
Fields marked UNVERIFIED below are the ones to check against the current GKE Pathways docs.

Needs JobSet >= v0.8 (spec.coordinator) and Kubernetes >= 1.29 (the sidecar containers). render.render()
checks the inputs shared with the GPU JobSet, calls _pathways_objects, and validates what it returns.
"""

import math
import re
from types import SimpleNamespace

from launch.k8s.common import (
  CONTAINER,
  JOBSET_API,
  WORKER_JOB,
  RenderError,
  _check_hostname,
  _env,
  _main_container,
  _user_error_policies,
  _volumes,
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
  trainer = _main_container(
    o,
    [
      head_address(),
      # The JAX client talks to the proxy; trainer/cluster/pathways.py and pathwaysutils key on "proxy".
      _env("JAX_PLATFORMS", "proxy"),
      _env("JAX_BACKEND_TARGET", f"grpc://$(PATHWAYS_HEAD):{PATHWAYS_PROXY_PORT}"),
      _env("XCLOUD_ENVIRONMENT", "GCP"),  # UNVERIFIED: set by pathways-job for the client.
    ],
    mounts,
  )
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
