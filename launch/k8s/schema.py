"""Validates the Kubernetes objects launch/k8s/render.py emits, offline: no cluster and no network.

Each object is checked twice, and every error of both is reported:

- Its structure: the field names (strict: an unknown field is an error, the usual way a hand-edited
  manifest goes wrong and one `kubectl apply` may only warn about), their types and the required ones.
  Core kinds (Service, Secret, NetworkPolicy) go through kubernetes-validate in strict mode, which ships the
  Kubernetes OpenAPI schemas of each release in the package (it reports an object's first error). The
  JobSet goes through `jsonschema` against the JobSet CRD's schema vendored in launch/k8s/vendor/,
  whose Job template refers to the same Kubernetes definitions.
- What the API server checks beyond those schemas (DNS names, enum values, quantities, one volume
  source, ...): the rules in launch/k8s/api_rules.py, also through `jsonschema`.

Both are checked against KUBERNETES_VERSION, the oldest release the manifests need, so a field a newer
release added is an error too. The packages are the `k8s` extra: pip install -c constraints.txt '.[k8s]'.
"""

import functools
import json
import os
import re

try:
  import jsonschema
  import kubernetes_validate
  import referencing
  from kubernetes_validate.utils import schema_contents
except ImportError as e:  # Rendering needs them; training does not.
  raise ImportError(
    f"{e}: rendering Kubernetes manifests needs the k8s extra: pip install -c constraints.txt '.[k8s]'"
  ) from e

from launch.k8s.api_rules import RULES

# The sidecar containers of --pathways (an init container's restartPolicy) need 1.29.
KUBERNETES_VERSION = "1.29.0"
JOBSET_SCHEMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vendor", "jobset-v1alpha2.json")
CORE_KINDS = {("v1", "Service"), ("v1", "Secret"), ("networking.k8s.io/v1", "NetworkPolicy")}
KINDS = sorted({("jobset.x-k8s.io/v1alpha2", "JobSet"), *CORE_KINDS})


@functools.cache
def _jobset_validator() -> jsonschema.Draft202012Validator:
  # kubernetes-validate's strict definitions of KUBERNETES_VERSION, which the vendored schema refers to;
  # a registry with no retrieve function: a reference to anything else is an error, never a download.
  definitions = schema_contents(
    f"kubernetes-json-schema/v{KUBERNETES_VERSION}-local-strict/_definitions.json", KUBERNETES_VERSION
  )
  registry = referencing.Resource.from_contents(definitions) @ referencing.Registry()
  with open(JOBSET_SCHEMA) as f:
    jobset = json.load(f)
  return jsonschema.Draft202012Validator(jobset, registry=registry)


@functools.cache
def _rules_validator(kind: str) -> jsonschema.Draft202012Validator:
  return jsonschema.Draft202012Validator({**RULES, "$ref": f"#/$defs/{kind}"})


def _path(error: jsonschema.ValidationError) -> str:
  """'$.spec.replicatedJobs[0].name': where in the object the error is."""
  path = "$"
  for part in error.absolute_path:
    if isinstance(part, int):
      path += f"[{part}]"
    else:
      path += f".{part}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part) else f"[{part!r}]"
  return path


def _message(error: jsonschema.ValidationError) -> str:
  """jsonschema's message, and the rule in words where api_rules.py gives one (its `$comment`); for
  a mapping or a list the rule alone, not the whole of it that jsonschema's message would print."""
  rule = error.schema.get("$comment") if isinstance(error.schema, dict) else None
  if rule is None:
    return f"{_path(error)}: {error.message}"
  if isinstance(error.instance, dict | list):
    return f"{_path(error)}: {rule}"
  return f"{_path(error)}: {error.message} ({rule})"


def _structure_errors(manifest: dict, key: tuple[str, str]) -> list[jsonschema.ValidationError]:
  if key in CORE_KINDS:
    try:
      kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
      return [e]
    return []
  return list(_jobset_validator().iter_errors(manifest))


def validate_object(manifest: dict) -> list[str]:
  """Every violation in one Kubernetes object, each as 'KIND/NAME PATH: what is wrong'; [] when it
  conforms. An object of a kind the renderer does not emit is an error: it has no rules here."""
  if not isinstance(manifest, dict):
    return [f"$: an object must be a mapping, got {type(manifest).__name__}"]
  key = (manifest.get("apiVersion"), manifest.get("kind"))
  if key not in KINDS:
    return [f"$: no schema for apiVersion={key[0]!r} kind={key[1]!r} (known: {KINDS})"]
  errors = _structure_errors(manifest, key) + list(_rules_validator(key[1]).iter_errors(manifest))
  # By place in the object, the outer first: the two checks' errors on one field come together.
  errors.sort(key=lambda e: [(0, p, "") if isinstance(p, int) else (1, 0, p) for p in e.absolute_path])
  metadata = manifest.get("metadata")
  name = metadata.get("name", "?") if isinstance(metadata, dict) else "?"
  return [f"{key[1]}/{name} {_message(e)}" for e in errors]
