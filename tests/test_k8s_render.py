"""launch/k8s/render.py: the GPU JobSet manifest against the schemas and rules of launch/k8s/schema.py,
its wiring into trainer/cluster/runtime.py, bad input, the CLI, and the validator itself. No cluster, no
network.
The Pathways variant and trainer/cluster/pathways.py: tests/test_k8s_pathways.py,
which shares BASE, CLI and the helpers below."""

import copy
import json
import socket
import subprocess
import sys

import jsonschema
import pytest
import yaml

from launch import gpu_flags
from launch.k8s import api_rules, schema
from launch.k8s import render as k8s
from tests.conftest import REPO
from trainer.cluster import runtime

BASE = dict(
  image="registry.example/jax-template:1",
  command_args=["--config.steps=1000", "--config.mesh.fsdp=8"],
  config="configs/lm_125m.py",
  workdir="/runs/lm_125m",
  replicas=4,
  pvc="runs",
)


def _by_kind(objects):
  return {o["kind"]: o for o in objects}


def _job(jobset, name):
  [replicated] = [r for r in jobset["spec"]["replicatedJobs"] if r["name"] == name]
  return replicated


def _container(pod_spec, name="trainer"):
  [container] = [c for c in pod_spec["containers"] if c["name"] == name]
  return container


def _env(container):
  return {e["name"]: e for e in container["env"]}


def _gpu_pod(objects):
  return _job(_by_kind(objects)["JobSet"], "worker")["template"]["spec"]["template"]["spec"]


# --- The validator itself: it must reject, or the schema tests below prove nothing.


def test_validator_rejects_unknown_keys_wrong_types_and_missing_fields():
  objects = k8s.render(**BASE)
  service, jobset = _by_kind(objects)["Service"], _by_kind(objects)["JobSet"]

  def errors(o, mutate):
    broken = copy.deepcopy(o)
    mutate(broken)
    return schema.validate_object(broken)

  assert schema.validate_object(service) == [] and schema.validate_object(jobset) == []
  at = "Service/train $.spec"
  assert errors(service, lambda s: s["spec"].update(c=2)) == [
    f"{at}: Additional properties are not allowed ('c' was unexpected)"
  ]
  port = lambda value: lambda s: s["spec"]["ports"][0].update(port=value)
  assert errors(service, port(True)) == [f"{at}.ports[0].port: True is not of type 'integer'"]  # No integer.
  assert errors(service, port(0)) == [f"{at}.ports[0].port: 0 is less than the minimum of 1"]
  assert errors(service, lambda s: s["spec"]["ports"][0].pop("port")) == [
    f"{at}.ports[0]: 'port' is a required property"
  ]
  # Every error of an object at once (kubernetes-validate, for the core kinds, stops at the first).
  replicated = lambda js: js["spec"]["replicatedJobs"][0]
  assert errors(jobset, lambda js: (replicated(js).pop("name"), replicated(js).update(replicas=[1]))) == [
    "JobSet/train $.spec.replicatedJobs[0]: 'name' is a required property",
    "JobSet/train $.spec.replicatedJobs[0].replicas: [1] is not of type 'integer'",
  ]
  assert schema.validate_object([]) == ["$: an object must be a mapping, got list"]


def test_the_schemas_are_json_schema_and_need_no_network(monkeypatch):
  with open(schema.JOBSET_SCHEMA) as f:
    jsonschema.Draft202012Validator.check_schema(json.load(f))
  jsonschema.Draft202012Validator.check_schema(api_rules.RULES)

  def no_network(*args):
    raise AssertionError("validating a manifest tried the network")

  monkeypatch.setattr(socket.socket, "connect", no_network)
  schema._jobset_validator.cache_clear()  # Loaded again, every schema it refers to with it.
  for o in k8s.render(**BASE) + k8s.render(**dict(BASE, pathways=True, gcs_scratch="gs://b/p")):
    assert schema.validate_object(o) == []


@pytest.mark.parametrize(
  "mutate, fragment",
  [
    (
      lambda js, pod: js["spec"]["replicatedJobs"][0]["template"]["spec"].update(paralelism=2),
      "'paralelism'",
    ),
    (lambda js, pod: js["spec"].update(replicas=2), "('replicas' was unexpected)"),
    (lambda js, pod: pod["containers"][0].update(gpus=8), "('gpus' was unexpected)"),
    (
      lambda js, pod: pod["containers"][0]["env"][1].update(value=4),
      ".env[1].value: 4 is not of type 'string'",
    ),
    (
      lambda js, pod: js["spec"]["replicatedJobs"][0].update(replicas="1"),
      ".replicas: '1' is not of type 'integer'",
    ),
    (lambda js, pod: pod.update(containers=[]), ".containers: [] should be non-empty"),
    (lambda js, pod: pod["containers"][0].pop("image"), "'image' is a required property"),
    (lambda js, pod: pod.update(restartPolicy="Sometimes"), "'Sometimes' is not one of"),
    (
      lambda js, pod: pod["containers"][0].update(restartPolicy="Always"),
      "only an init container may set restartPolicy",
    ),
    (lambda js, pod: pod["volumes"][0].update(emptyDir={}), "exactly one source"),
    (
      lambda js, pod: js["spec"]["replicatedJobs"][0]["template"]["spec"].update(completionMode="Ordered"),
      "Indexed",
    ),
    (lambda js, pod: js["spec"]["failurePolicy"].update(maxRestarts=-1), "-1 is less than the minimum of 0"),
    (lambda js, pod: js.update(apiVersion="jobset.x-k8s.io/v1"), "no schema for"),
    (lambda js, pod: js["metadata"].update(name="Train_1"), "does not match"),
    (lambda js, pod: pod["containers"][0]["resources"]["limits"].update(cpu="lots"), "does not match"),
  ],
)
def test_schema_catches_a_broken_manifest(mutate, fragment):
  objects = copy.deepcopy(k8s.render(**BASE))
  jobset = _by_kind(objects)["JobSet"]
  mutate(jobset, _gpu_pod([jobset]))
  errors = schema.validate_object(jobset)
  assert any(fragment in e for e in errors), errors


# --- The manifests.


def test_gpu_manifest_conforms_to_the_schemas():
  objects = k8s.render(**BASE)
  assert [o["kind"] for o in objects] == ["Service", "NetworkPolicy", "Secret", "JobSet"]  # Apply order.
  for o in objects:
    assert schema.validate_object(o) == []
  [error] = schema.validate_object(json.loads(k8s.to_json(objects)))  # A kind it does not model.
  assert error.startswith("$: no schema for apiVersion='v1' kind='List'")
  bare = k8s.render(**BASE, service=False, network_policy=False)
  assert [o["kind"] for o in bare] == ["Secret", "JobSet"]


def test_every_pod_reads_the_jobs_own_peer_secret_and_another_rendering_gets_another():
  """trainer/cluster/peers.py refuses a caller without the secret: each pod mounts it read-only for
  its user and names the file in PEER_SECRET_FILE; the secret is made anew per rendering."""
  objects = k8s.render(**BASE)
  secret, pod = _by_kind(objects)["Secret"], _gpu_pod(objects)
  assert len(secret["stringData"]["secret"]) == 64
  [volume] = [v for v in pod["volumes"] if "secret" in v]
  assert volume["secret"] == {"secretName": secret["metadata"]["name"], "defaultMode": 0o400}
  [mount] = [m for m in _container(pod)["volumeMounts"] if m["name"] == volume["name"]]
  assert mount["readOnly"] is True
  assert _env(_container(pod))["PEER_SECRET_FILE"]["value"] == f"{mount['mountPath']}/secret"
  assert _by_kind(k8s.render(**BASE))["Secret"]["stringData"] != secret["stringData"]


def test_only_the_jobs_own_pods_reach_the_coordinator_and_peer_ports():
  """Process I's peer service listens on 1234 + 1 + I (trainer/cluster/peers.py): 1235..1238 for 4."""
  objects = k8s.render(**BASE, port=1234)
  policy = _by_kind(objects)["NetworkPolicy"]
  own = {"podSelector": {"matchLabels": {"jobset.sigs.k8s.io/jobset-name": BASE.get("name", "train")}}}
  assert policy["spec"]["podSelector"] == own["podSelector"] and policy["spec"]["policyTypes"] == ["Ingress"]
  mine, everyone = policy["spec"]["ingress"]
  assert mine == {
    "from": [own]
  }  # Every port, the coordinator's and the peers' included, from the job's pods.
  assert "from" not in everyone  # From anywhere: every port but 1234..1238.
  ranges = {(p["protocol"], p["port"], p["endPort"]) for p in everyone["ports"]}
  assert ranges == {(proto, lo, hi) for proto in ("TCP", "UDP") for lo, hi in ((1, 1233), (1239, 65535))}
  assert _env(_container(_gpu_pod(objects)))["PEER_PORT_BASE"]["value"] == "1235"
  with pytest.raises(k8s.RenderError, match=r"port=65533: must be in \[1, 65531\]: the 4 processes' peer"):
    k8s.render(**BASE, port=65533)


@pytest.mark.parametrize("replicas", [1, 3, 16])
def test_replicas_completions_and_parallelism_agree(replicas):
  jobset = _by_kind(k8s.render(**dict(BASE, replicas=replicas)))["JobSet"]
  [replicated] = jobset["spec"]["replicatedJobs"]
  job = replicated["template"]["spec"]
  assert replicated["replicas"] == 1  # One Job: its pods are the processes.
  assert job["parallelism"] == job["completions"] == replicas
  assert job["completionMode"] == "Indexed"
  assert job["backoffLimit"] == 0  # Any failed pod fails the Job; JobSet restarts every pod.
  assert job["template"]["spec"]["restartPolicy"] == "Never"
  assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 10
  assert _env(_container(job["template"]["spec"]))["JAX_NUM_PROCESSES"]["value"] == str(replicas)


def test_env_wiring_names_the_coordinator_and_the_completion_index():
  objects = k8s.render(**BASE, name="lm", port=1234)
  service, jobset = _by_kind(objects)["Service"], _by_kind(objects)["JobSet"]
  pod = _gpu_pod(objects)
  env = _env(_container(pod))
  subdomain = jobset["spec"]["network"]["subdomain"]
  assert subdomain == pod["subdomain"] == service["metadata"]["name"] == "lm"
  assert jobset["spec"]["network"]["enableDNSHostnames"] is True
  # Pod host names are <jobset>-<replicated job>-<job index>-<completion index>.
  assert env["JAX_COORDINATOR_ADDRESS"]["value"] == f"lm-worker-0-0.{subdomain}:1234"
  assert env["JAX_PROCESS_ID"]["valueFrom"] == {
    "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
  }
  assert service["spec"]["clusterIP"] == "None"
  assert service["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": "lm"}
  assert {"name": "coordinator", "containerPort": 1234} in _container(pod)["ports"]


def test_the_env_it_sets_is_what_trainer_runtime_joins_with(monkeypatch):
  """The rendered env, as Kubernetes would resolve it for pod 2, reaches jax.distributed.initialize."""
  container = _container(_gpu_pod(k8s.render(**BASE)))
  resolved = {e["name"]: e.get("value", "2") for e in container["env"]}  # fieldRef: completion index 2.
  for name in (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
  ):
    monkeypatch.delenv(name, raising=False)
  for name, value in resolved.items():
    monkeypatch.setenv(name, value)
  calls = []
  monkeypatch.setattr(runtime, "_initialize", lambda *args: calls.append(args))
  runtime.join_job(None, None, None)
  assert [call[:3] for call in calls] == [("train-worker-0-0.train:55527", 4, 2)]


def test_command_runs_main_with_config_workdir_and_the_extra_flags():
  container = _container(_gpu_pod(k8s.render(**BASE)))
  assert container["command"] == ["python", "main.py"]
  assert container["args"] == [
    "--config=configs/lm_125m.py",
    "--workdir=/runs/lm_125m",
    "--config.steps=1000",
    "--config.mesh.fsdp=8",
    "--config.compilation_cache=/runs/.compilation_cache",  # On the claim: it outlives every pod.
    "--config.checkpoint.local_dir=/local-tier",  # The node's folder: it outlives a JobSet restart.
  ]
  assert container["workingDir"] == "/app"
  assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}


def test_workdir_volume_and_shared_memory():
  pod = _gpu_pod(k8s.render(**BASE, mount_path="/runs", shm_size="8Gi"))
  volumes = {v["name"]: v for v in pod["volumes"]}
  mounts = {m["name"]: m["mountPath"] for m in _container(pod)["volumeMounts"]}
  assert volumes["workdir"]["persistentVolumeClaim"] == {"claimName": "runs"}
  assert mounts == {
    "workdir": "/runs",
    "dshm": "/dev/shm",
    "local-tier": "/local-tier",
    "peer-secret": "/var/run/peer-secret",
  }
  assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
  # The local checkpoint tier on the node (memory-backed), per job: a recreated pod finds its copies.
  assert volumes["local-tier"]["hostPath"] == {
    "path": "/dev/shm/jax-template/train",
    "type": "DirectoryOrCreate",
  }
  # A gs:// workdir mounts nothing; no shm_size keeps the default /dev/shm; no local tier host path
  # leaves local_dir to the config; 0 GPUs: a CPU-only pod.
  pod = _gpu_pod(
    k8s.render(
      **dict(BASE, workdir="gs://bucket/run", pvc=None),
      shm_size=None,
      local_tier_host_path=None,
      gpus_per_replica=0,
    )
  )
  assert [v["name"] for v in pod["volumes"]] == ["peer-secret"]  # Only the job's secret.
  assert [m["name"] for m in _container(pod)["volumeMounts"]] == ["peer-secret"]
  assert "resources" not in _container(pod)


def test_user_error_exit_fails_the_jobset_instead_of_restarting_it():
  jobset = _by_kind(k8s.render(**BASE))["JobSet"]
  [rule] = _job(jobset, "worker")["template"]["spec"]["podFailurePolicy"]["rules"]
  assert rule == {
    "action": "FailJob",
    "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [2, 4, 5, 6, 7, 8]},
  }
  [js_rule] = jobset["spec"]["failurePolicy"]["rules"]
  assert js_rule["action"] == "FailJobSet" and js_rule["onJobFailureReasons"] == ["PodFailurePolicy"]


def test_a_preempted_run_exits_non_zero_so_the_jobset_restarts_it():
  """A preempted run that exited 0 on every pod would complete the Job; 2 would fail the JobSet."""
  code = _env(_container(_gpu_pod(k8s.render(**BASE))))["PREEMPTED_EXIT_CODE"]["value"]
  assert int(code) not in (0, k8s.USER_ERROR_EXIT)


# --- Bad input: a clear error, never a manifest that fails on the cluster.


@pytest.mark.parametrize(
  "overrides, fragment",
  [
    (dict(replicas=0), "replicas=0: must be a whole number of at least 1"),
    (dict(replicas=-2), "replicas=-2"),
    (dict(replicas=2.0), "replicas=2.0"),
    (dict(image=""), "image is empty"),
    (dict(image="   "), "image is empty"),
    (dict(image="a b"), "whitespace"),
    (dict(config=""), "config is empty"),
    (dict(workdir=""), "workdir is empty"),
    (dict(pvc=None), "give pvc=CLAIM"),
    (dict(workdir="/data/run"), "outside the volume mounted at /runs"),
    (dict(workdir="/runs/../etc"), "outside the volume"),
    (dict(workdir="runs/x"), "workdir='runs/x': must be an absolute path"),
    (dict(name="Train"), "name='Train'"),
    (dict(name="x" * 60), "exceeds 63 characters"),
    (dict(command_args=["--workdir=/elsewhere"]), "--workdir is set by the manifest"),
    (dict(command_args=["--process_id=0"]), "--process_id is set by the manifest"),
    (dict(command_args="--config.steps=3"), "a list of flags"),
    (dict(command_args=["--cpu_devices=8"]), "GPUs per pod would sit idle"),
    (dict(gpus_per_replica=-1), "gpus_per_replica=-1"),
    (dict(env={"STEPS": 3}), "as strings"),
    (dict(env={"1BAD": "x"}), "the manifest would be invalid"),
    (dict(max_restarts=-1), "max_restarts=-1"),
  ],
)
def test_bad_input_is_rejected_with_a_clear_error(overrides, fragment):
  with pytest.raises(k8s.RenderError) as e:
    k8s.render(**{**BASE, **overrides})
  assert fragment in str(e.value)


# --- The CLI.

CLI = [
  "--image=registry.example/jax-template:1",
  "--replicas=4",
  "--pvc=runs",
  "--config=configs/lm_125m.py",
  "--workdir=/runs/lm_125m",
  "--",
  "--config.steps=1000",
  "--config.mesh.fsdp=8",
]


def _unsecret(objects: list[dict]) -> list[dict]:  # The peer secret's value is new per rendering.
  return [{**o, "stringData": "..."} if o["kind"] == "Secret" else o for o in objects]


def test_cli_writes_yaml_to_stdout(capsys):
  assert k8s.main(CLI) == 0
  assert _unsecret(list(yaml.safe_load_all(capsys.readouterr().out))) == _unsecret(k8s.render(**BASE))


def test_cli_writes_json_to_a_file(tmp_path, capsys):
  out = tmp_path / "job.json"
  assert k8s.main(["--format=json", f"--output={out}", *CLI]) == 0
  document = json.loads(out.read_text())
  assert document["kind"] == "List" and _unsecret(document["items"]) == _unsecret(k8s.render(**BASE))
  assert "wrote" in capsys.readouterr().err


def test_cli_bad_input_is_one_error_line(capsys):
  assert k8s.main([a if a != "--replicas=4" else "--replicas=0" for a in CLI]) == 2
  assert capsys.readouterr().err.splitlines() == ["error: replicas=0: must be a whole number of at least 1"]
  assert k8s.main(["--env=NOEQUALS", *CLI]) == 2
  assert capsys.readouterr().err.startswith("error: --env='NOEQUALS': must be KEY=VALUE")


def test_cli_runs_as_a_script():
  result = subprocess.run(
    [sys.executable, "launch/k8s/render.py", "--format=json", *CLI], cwd=REPO, capture_output=True, text=True
  )
  assert result.returncode == 0, result.stderr
  assert _unsecret(json.loads(result.stdout)["items"]) == _unsecret(k8s.render(**BASE))


def test_yaml_output_falls_back_to_json_without_pyyaml(monkeypatch):
  monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` now raises ImportError.
  objects = k8s.render(**BASE)
  assert json.loads(k8s.to_yaml(objects))["items"] == objects


def test_gpu_pods_get_xla_gpu_flags_before_the_users_own():
  flags = lambda **kw: _env(_container(_gpu_pod(k8s.render(**{**BASE, **kw}))))["XLA_FLAGS"]["value"]
  assert flags() == gpu_flags.xla_flags()
  assert flags(env={"XLA_FLAGS": "--xla_dump_to=/tmp/d"}).split() == [
    *gpu_flags.xla_flags().split(),
    "--xla_dump_to=/tmp/d",
  ]
