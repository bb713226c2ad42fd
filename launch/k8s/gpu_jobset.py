"""Builds the GPU variant of the JobSet (launch/k8s/render.py without --pathways): `replicas` pods of one
indexed Job, one process each, joined by jax.distributed through pod 0; with the headless Service that
names pod 0 and the NetworkPolicy that guards its coordinator and peer ports. render.render() checks the
inputs, calls _gpu_objects and validates what it returns; render.py's docstring says what the manifest
does.
"""

import secrets
from types import SimpleNamespace

from launch import gpu_flags
from launch.k8s.common import (
  CONTAINER,
  JOBSET_API,
  WORKER_JOB,
  _check_hostname,
  _env,
  _main_container,
  _user_error_policies,
  _volumes,
)

# JAX's own Kubernetes auto-detection (jax/_src/clusters/k8s_cluster.py) uses this port; the same one
# here means nothing surprises someone who knows that path.
COORDINATOR_PORT = 55527
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# trainer/cluster/peers.py: process I's peer service (the link probes between every pair of processes)
# listens on PEER_PORT_BASE + I; the manifest sets the base to the coordinator port + 1, its default.
PEER_PORT_BASE_ENV = "PEER_PORT_BASE"
PEER_SECRET_MOUNT = "/var/run/peer-secret"  # The Secret's file `secret`: PEER_SECRET_FILE.
LOCAL_TIER_MOUNT = "/local-tier"  # Where the pod sees its node's local-tier folder (checkpoint.local_dir).


def peer_ports(port: int, replicas: int) -> tuple[int, int]:
  """The first and last port of the processes' peer services."""
  return port + 1, port + replicas


def _gpu_objects(o: SimpleNamespace) -> list[dict]:
  _check_hostname(o.name, WORKER_JOB, 1, o.replicas)
  coordinator = f"{o.name}-{WORKER_JOB}-0-0.{o.name}:{o.port}"
  volumes, mounts = _volumes(o.workdir, o.pvc, o.mount_path, o.shm_size)
  if o.local_tier_host_path:  # The local checkpoint tier outlives the pod on its node.
    path = f"{o.local_tier_host_path.rstrip('/')}/{o.name}"
    volumes.append({"name": "local-tier", "hostPath": {"path": path, "type": "DirectoryOrCreate"}})
    mounts.append({"name": "local-tier", "mountPath": LOCAL_TIER_MOUNT})
  # The peer service's secret (trainer/cluster/peers.py), readable by the container's user only.
  volumes.append({"name": "peer-secret", "secret": {"secretName": f"{o.name}-peer", "defaultMode": 0o400}})
  mounts.append({"name": "peer-secret", "mountPath": PEER_SECRET_MOUNT, "readOnly": True})
  # XLA's GPU throughput flags (launch/gpu_flags.py), then an --env XLA_FLAGS of yours: later ones win.
  xla_flags = []
  if o.gpus_per_replica:
    xla_flags = [_env("XLA_FLAGS", f"{gpu_flags.xla_flags()} {o.env.pop('XLA_FLAGS', '')}".strip())]
  container = _main_container(
    o,
    [
      # trainer/cluster/runtime.py joins the job from these three (jax.distributed.initialize with them).
      _env("JAX_COORDINATOR_ADDRESS", coordinator),
      _env("JAX_NUM_PROCESSES", str(o.replicas)),
      _env("JAX_PROCESS_ID", field=COMPLETION_INDEX),
      _env(PEER_PORT_BASE_ENV, str(peer_ports(o.port, o.replicas)[0])),
      _env("PEER_SECRET_FILE", f"{PEER_SECRET_MOUNT}/secret"),
      *xla_flags,
    ],
    mounts,
    ports=[{"name": "coordinator", "containerPort": o.port}],
    # An extended resource: the request defaults to the limit; GKE adds the GPU-node toleration itself.
    **({"resources": {"limits": {"nvidia.com/gpu": o.gpus_per_replica}}} if o.gpus_per_replica else {}),
  )
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
  objects = [_peer_secret(o.name, o.namespace), jobset]
  if o.network_policy:
    objects.insert(0, _coordinator_policy(o.name, o.namespace, o.port, o.replicas))
  if o.service:
    # The JobSet controller creates this headless Service itself when it is missing; rendering it keeps
    # the coordinator's DNS name visible in the manifest and works with JobSet versions that do not.
    objects.insert(0, _headless_service(o.name, o.namespace, o.port))
  return objects


def _coordinator_policy(name: str, namespace: str, port: int, replicas: int) -> dict:
  """Admits the coordinator port and the peer services' ports (port + 1 .. port + replicas) only from the
  job's own pods: JAX's coordination service has no authentication, so anyone who reaches it could join or
  disturb the job (the peer service refuses callers without the job's secret, but is kept as close). Every
  other port stays open as without a policy (NCCL between the pods, a metrics scraper): one rule for the
  job's pods, one for everyone that leaves out those ports. Needs a network plugin that enforces
  policies."""
  pods = {"podSelector": {"matchLabels": {"jobset.sigs.k8s.io/jobset-name": name}}}
  last = peer_ports(port, replicas)[1]  # The coordinator's port, then the peer range right above it.
  others = [{"port": lo, "endPort": hi} for lo, hi in ((1, port - 1), (last + 1, 65535)) if lo <= hi]
  return {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": f"{name}-coordinator", "namespace": namespace},
    "spec": {
      **pods,
      "policyTypes": ["Ingress"],
      "ingress": [
        {"from": [pods]},
        {"ports": [{"protocol": p, **r} for p in ("TCP", "UDP") for r in others]},
      ],
    },
  }


def _peer_secret(name: str, namespace: str) -> dict:
  """A secret made here, per rendering: every pod of the job mounts it; a stranger who reaches the peer
  ports without it is refused. Render again for a new one."""
  return {
    "apiVersion": "v1",
    "kind": "Secret",
    "metadata": {"name": f"{name}-peer", "namespace": namespace},
    "type": "Opaque",
    "stringData": {"secret": secrets.token_hex(32)},
  }


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
