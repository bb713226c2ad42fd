"""What the GPU and the Pathways JobSets share: RenderError, the input checks, and the pieces of a pod.

launch/k8s/render.py builds the GPU JobSet and launch/k8s/pathways_jobset.py the Pathways one from these:
the container env entries, the workdir and /dev/shm volumes, the podFailurePolicy that makes the exits
a restart would repeat (exit_codes.py) fail the JobSet instead of restarting it, and the
checks that turn bad input into a RenderError that says what to change.
"""

import os
import re

import exit_codes

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
WORKER_JOB = "worker"
CONTAINER = "trainer"
# main.py's exit after a user's mistake: bad flags or config, which the next attempt would repeat.
USER_ERROR_EXIT = exit_codes.USER_EXIT
# Exits a restart would repeat (exit_codes.py's table: a user error, a device that
# computed wrong, out of memory, a miscompiled step). They fail the JobSet instead of restarting it.
NO_RESTART_EXITS = list(exit_codes.NEVER_RESTART)
# A run stopped by SIGTERM (preemption) saves and, by default, exits 0: every pod exiting 0 would mark the
# Job, and the JobSet, "Completed" with steps left. With PREEMPTED_EXIT_CODE set, trainer/run.py exits
# with that code instead: a failure, which the JobSet answers by restarting every pod, and they resume
# from the checkpoint just saved.
PREEMPTED_EXIT_CODE = exit_codes.PREEMPTED_EXIT  # 128 + SIGTERM, the shell's convention.
# Flags the manifest sets itself; given after `--` they would contradict it.
RESERVED_FLAGS = (
  "--config",
  "--workdir",
  "--coordinator_address",
  "--num_processes",
  "--process_id",
  "--pathways",
)


class RenderError(ValueError):
  """Input the manifest cannot be made from; the message says what to change."""


def _env(name: str, value: str | None = None, field: str | None = None) -> dict:
  if field is not None:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field}}}
  return {"name": name, "value": value}


def _main_container(o, env: list[dict], mounts: list[dict], **fields) -> dict:
  """The container that runs main.py: `env` first, then what every variant sets (unbuffered output,
  the preempted exit code, the user's --env), then `fields` (ports, resources) and the mounts."""
  return {
    "name": CONTAINER,
    "image": o.image,
    "workingDir": o.working_dir,
    "command": ["python", "main.py"],
    "args": o.args,
    "env": [
      *env,
      _env("PYTHONUNBUFFERED", "1"),  # Lines reach `kubectl logs` as they are printed.
      # A preempted run exits with this, so that its Job fails (and restarts) instead of completing.
      _env("PREEMPTED_EXIT_CODE", str(PREEMPTED_EXIT_CODE)),
      *(_env(k, v) for k, v in o.env.items()),
    ],
    **fields,
    "volumeMounts": mounts,
  }


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
    raise RenderError("config is empty: give the config file main.py should read, e.g. configs/lm_125m.py")
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
  """(Job podFailurePolicy, JobSet failurePolicy rule): an exit that exit_codes.NEVER_RESTART holds ends
  the JobSet, not a restart.

  The Job's failure reason is PodFailurePolicy only when this rule matched; other failures (a crash, a
  lost node, a peer that timed out) keep JobSet's default action, RestartJobSet.
  """
  pod_failure_policy = {
    "rules": [
      {
        "action": "FailJob",
        "onExitCodes": {"containerName": container, "operator": "In", "values": NO_RESTART_EXITS},
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
