"""launch/k8s/pathways_jobset.py (render.py --pathways): the Pathways-on-GKE JobSet against the vendored
schemas, its env wiring and command, bad input, the CLI; and trainer/cluster/pathways.py.
No cluster, no TPU, no network. The GPU manifest, the CLI and the schema validator:
tests/test_k8s_render.py."""

import sys
import types

import jax
import pytest
import yaml

from errors import UserError
from launch.k8s import render as k8s
from launch.k8s import schema
from tests.test_k8s_render import BASE, CLI, _by_kind, _container, _env, _job
from trainer.cluster import pathways

PATHWAYS = dict(BASE, pathways=True, gcs_scratch="gs://bucket/pathways", tpu="v5e", topology="4x4")

# --- The manifest.


def test_a_preempted_run_exits_non_zero_so_the_jobset_restarts_it():
  """A preempted head that exited 0 would complete the head Job (and the JobSet); 2 would fail the JobSet."""
  head = _job(_by_kind(k8s.render(**PATHWAYS))["JobSet"], "pathways-head")
  code = _env(_container(head["template"]["spec"]["template"]["spec"]))["PREEMPTED_EXIT_CODE"]["value"]
  assert int(code) not in (0, k8s.USER_ERROR_EXIT)


@pytest.mark.parametrize(
  "tpu, topology, hosts, chips, instance_type",
  [
    ("v5e", "4x4", 4, 4, "tpuv5e:4x4"),
    ("v5p", "2x2x2", 2, 4, "tpuv5:2x2x2"),
    ("v6e", "1x1", 1, 1, "tpuv6e:1x1"),
  ],
)
def test_pathways_manifest(tpu, topology, hosts, chips, instance_type):
  objects = k8s.render(**dict(PATHWAYS, tpu=tpu, topology=topology, replicas=2))
  assert [o["kind"] for o in objects] == ["JobSet"]
  [jobset] = objects
  assert schema.validate_object(jobset) == []
  spec = jobset["spec"]
  assert [r["name"] for r in spec["replicatedJobs"]] == ["pathways-head", "worker"]
  assert spec["coordinator"] == {"replicatedJob": "pathways-head", "jobIndex": 0, "podIndex": 0}
  assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["pathways-head"]}

  head = _job(jobset, "pathways-head")
  assert head["replicas"] == 1
  assert head["template"]["spec"]["parallelism"] == head["template"]["spec"]["completions"] == 1
  head_pod = head["template"]["spec"]["template"]["spec"]
  sidecars = {c["name"]: c for c in head_pod["initContainers"]}
  assert set(sidecars) == {"pathways-rm", "pathways-proxy"}
  assert all(c["restartPolicy"] == "Always" for c in sidecars.values())
  assert f"--instance_type={instance_type}" in sidecars["pathways-rm"]["args"]
  assert "--instance_count=2" in sidecars["pathways-rm"]["args"]
  trainer = _container(head_pod)
  assert trainer["command"] == ["python", "main.py"]
  assert trainer["args"][:3] == ["--pathways", "--config=configs/lm_125m.py", "--workdir=/runs/lm_125m"]
  env = _env(trainer)
  assert env["JAX_PLATFORMS"]["value"] == "proxy"
  assert env["JAX_BACKEND_TARGET"]["value"] == "grpc://$(PATHWAYS_HEAD):29000"
  assert env["PATHWAYS_HEAD"]["valueFrom"]["fieldRef"]["fieldPath"] == k8s.COORDINATOR_LABEL
  assert "JAX_PROCESS_ID" not in env  # One controller process: no jax.distributed.

  worker = _job(jobset, "worker")
  assert worker["replicas"] == 2  # TPU slices.
  assert worker["template"]["spec"]["parallelism"] == worker["template"]["spec"]["completions"] == hosts
  worker_pod = worker["template"]["spec"]["template"]["spec"]
  assert _container(worker_pod, "pathways-worker")["resources"] == {"limits": {"google.com/tpu": chips}}
  assert worker_pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == topology


# --- Bad input: a clear error, never a manifest that fails on the cluster.


@pytest.mark.parametrize(
  "overrides, fragment",
  [
    (dict(pathways=True), "gcs_scratch=None"),
    (dict(PATHWAYS, tpu="v9"), "tpu='v9'"),
    (dict(PATHWAYS, topology="4x4x4"), "takes 2 dimensions"),
    (dict(PATHWAYS, command_args=["--pathways"]), "--pathways is set by the manifest"),
  ],
)
def test_bad_input_is_rejected_with_a_clear_error(overrides, fragment):
  with pytest.raises(k8s.RenderError) as e:
    k8s.render(**{**BASE, **overrides})
  assert fragment in str(e.value)


# --- The CLI.


def test_cli_pathways(capsys):
  argv = ["--pathways", "--gcs_scratch=gs://bucket/pathways", "--tpu=v5p", "--topology=2x2x4", *CLI]
  assert k8s.main(argv) == 0
  text = capsys.readouterr().out
  assert (
    "&id" not in text and "*id" not in text
  )  # Written out in full: no YAML anchors for a reader to chase.
  documents = list(yaml.safe_load_all(text))
  assert documents == k8s.render(**dict(PATHWAYS, tpu="v5p", topology="2x2x4"))


# --- trainer/cluster/pathways.py


def test_initialize_without_pathwaysutils_is_a_user_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "pathwaysutils", None)  # Not installed, even where it is.
  with pytest.raises(UserError) as e:
    pathways.initialize()
  assert str(e.value) == "--pathways needs the pathwaysutils package: pip install pathwaysutils"


def _fake_pathwaysutils(monkeypatch, backend_target):
  module = types.ModuleType("pathwaysutils")
  module.calls = []
  module.initialize = lambda: module.calls.append(jax.config.jax_platforms)
  monkeypatch.setitem(sys.modules, "pathwaysutils", module)
  # JAX's global config stays untouched: other tests in this process run on CPU devices.
  updates = []
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
  real_read = jax.config.read
  monkeypatch.setattr(
    jax.config, "read", lambda name: backend_target if name == "jax_backend_target" else real_read(name)
  )
  return module, updates


def test_initialize_selects_the_proxy_platform_and_calls_pathwaysutils(monkeypatch):
  module, updates = _fake_pathwaysutils(monkeypatch, "grpc://head:29000")
  pathways.initialize()
  assert updates == [("jax_platforms", "proxy")]  # conftest set "cpu": pathwaysutils would do nothing.
  assert len(module.calls) == 1


def test_initialize_without_a_backend_target_is_a_user_error(monkeypatch):
  module, updates = _fake_pathwaysutils(monkeypatch, "")
  with pytest.raises(UserError, match="JAX_BACKEND_TARGET=grpc://HOST:PORT"):
    pathways.initialize()
  assert updates == [] and module.calls == []


@pytest.mark.parametrize(
  "flag, env, expected",
  [
    (True, {}, True),
    (False, {}, False),
    (False, {"JAX_PLATFORMS": "proxy"}, True),
    (False, {"JAX_PLATFORMS": "proxy,cpu"}, True),
    (False, {"JAX_PLATFORMS": "cuda"}, False),
    (False, {"PATHWAYS": "1"}, True),
    (False, {"PATHWAYS": "true"}, True),
    (False, {"PATHWAYS": "0"}, False),
    (False, {"PATHWAYS": "False"}, False),
    (False, {"PATHWAYS": ""}, False),
  ],
)
def test_requested(monkeypatch, flag, env, expected):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.delenv("PATHWAYS", raising=False)
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  assert pathways.requested(flag) is expected
