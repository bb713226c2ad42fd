"""A vendored subset of the Kubernetes API schemas that launch/k8s/render.py emits, and a validator.

No cluster and no network at test time, and no `jsonschema` package (not pinned): the subset below is
written by hand from the API types (core/v1 Pod, Service; batch/v1 Job; jobset.x-k8s.io/v1alpha2
JobSet) and covers only the fields the renderer uses, plus a few neighbours a user might add. Every
object level modelled here rejects keys it does not know, so a misspelt or misplaced field (the
usual way a hand-edited manifest goes wrong, and one `kubectl apply` may only warn about) fails a
test here instead of on the cluster.

Schemas are JSON-schema-like dicts, with only the keywords `validate` understands:
  type                "object" | "array" | "string" | "integer" | "boolean", or a list of them
  properties          {key: schema}; additionalProperties: False (reject unknown keys) or a schema
  required            keys that must be present
  exactly_one_of      keys of which exactly one must be present (a volume's source)
  at_most_one_of      keys of which at most one may be present (an env var's value or valueFrom)
  items, min_items    array elements and minimum length
  enum, const         allowed values
  pattern             re.fullmatch on strings; max_length on strings
  minimum, maximum    on integers
"""

import re

STRING = {"type": "string"}
INTEGER = {"type": "integer"}
NON_NEGATIVE = {"type": "integer", "minimum": 0}
POSITIVE = {"type": "integer", "minimum": 1}
BOOLEAN = {"type": "boolean"}
STRINGS = {"type": "array", "items": STRING}
STRING_MAP = {
  "type": "object",
  "additionalProperties": STRING,
}  # labels, annotations, selectors: string values
# RFC 1123 label: names of objects, containers, volumes and ports; at most 63 characters.
DNS_LABEL = {"type": "string", "pattern": r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", "max_length": 63}
# RFC 1123 subdomain: claim names may contain dots.
DNS_SUBDOMAIN = {"type": "string", "pattern": r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", "max_length": 253}
# A resource quantity: "8", 8, "16Gi", "500m" (the API also takes exponents; the renderer never writes them).
QUANTITY = {"type": ["string", "integer"], "pattern": r"\d+(\.\d+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?"}
QUANTITY_MAP = {"type": "object", "additionalProperties": QUANTITY}


def obj(properties: dict, required=(), **extra) -> dict:
  """An object schema that rejects keys it does not list."""
  return {
    "type": "object",
    "properties": properties,
    "required": list(required),
    "additionalProperties": False,
    **extra,
  }


def array(items: dict, min_items: int = 0) -> dict:
  return {"type": "array", "items": items, "min_items": min_items}


# --- meta/v1
OBJECT_META = obj(
  {
    "name": DNS_LABEL,
    "generateName": STRING,
    "namespace": DNS_LABEL,
    "labels": STRING_MAP,
    "annotations": STRING_MAP,
  }
)

# --- core/v1: the essentials of a Pod.
ENV_VAR = obj(
  {
    "name": {"type": "string", "pattern": r"[-._a-zA-Z][-._a-zA-Z0-9]*"},
    "value": STRING,  # A string, always: `value: 8` is rejected by the API server.
    "valueFrom": obj(
      {
        "fieldRef": obj({"fieldPath": STRING, "apiVersion": STRING}, required=["fieldPath"]),
        "secretKeyRef": obj({"name": STRING, "key": STRING, "optional": BOOLEAN}, required=["key"]),
        "configMapKeyRef": obj({"name": STRING, "key": STRING, "optional": BOOLEAN}, required=["key"]),
      },
      exactly_one_of=["fieldRef", "secretKeyRef", "configMapKeyRef"],
    ),
  },
  required=["name"],
  at_most_one_of=["value", "valueFrom"],  # Neither is legal too: the empty string.
)

CONTAINER_PORT = obj(
  {
    "name": DNS_LABEL,
    "containerPort": {"type": "integer", "minimum": 1, "maximum": 65535},
    "protocol": {"enum": ["TCP", "UDP", "SCTP"]},
  },
  required=["containerPort"],
)
VOLUME_MOUNT = obj(
  {"name": DNS_LABEL, "mountPath": STRING, "readOnly": BOOLEAN, "subPath": STRING},
  required=["name", "mountPath"],
)
RESOURCES = obj({"limits": QUANTITY_MAP, "requests": QUANTITY_MAP})
_CONTAINER_FIELDS = {
  "name": DNS_LABEL,
  "image": {"type": "string", "pattern": r"\S+"},
  "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
  "command": STRINGS,
  "args": STRINGS,
  "workingDir": STRING,
  "env": array(ENV_VAR),
  "ports": array(CONTAINER_PORT),
  "resources": RESOURCES,
  "volumeMounts": array(VOLUME_MOUNT),
  "securityContext": obj({"privileged": BOOLEAN}),
}
CONTAINER = obj(_CONTAINER_FIELDS, required=["name", "image"])
# An init container may carry `restartPolicy: Always`, which makes it a sidecar that runs beside the
# main containers (Kubernetes >= 1.29); a regular container may not have the field at all.
INIT_CONTAINER = obj({**_CONTAINER_FIELDS, "restartPolicy": {"const": "Always"}}, required=["name", "image"])

VOLUME = obj(
  {
    "name": DNS_LABEL,
    "persistentVolumeClaim": obj({"claimName": DNS_SUBDOMAIN, "readOnly": BOOLEAN}, required=["claimName"]),
    "emptyDir": obj({"medium": {"enum": ["", "Memory"]}, "sizeLimit": QUANTITY}),
    "hostPath": obj(
      {"path": STRING, "type": {"enum": ["", "DirectoryOrCreate", "Directory", "FileOrCreate", "File"]}},
      required=["path"],
    ),
  },
  required=["name"],
  exactly_one_of=["persistentVolumeClaim", "emptyDir", "hostPath"],
)
TOLERATION = obj(
  {
    "key": STRING,
    "operator": {"enum": ["Exists", "Equal"]},
    "value": STRING,
    "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
  }
)
POD_SPEC = obj(
  {
    "containers": array(CONTAINER, min_items=1),
    "initContainers": array(INIT_CONTAINER),
    "volumes": array(VOLUME),
    "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]},
    "subdomain": DNS_LABEL,
    "hostname": DNS_LABEL,
    "hostNetwork": BOOLEAN,
    "dnsPolicy": {"enum": ["ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"]},
    "terminationGracePeriodSeconds": NON_NEGATIVE,
    "nodeSelector": STRING_MAP,
    "tolerations": array(TOLERATION),
    "serviceAccountName": DNS_LABEL,
    "priorityClassName": STRING,
  },
  required=["containers"],
)
POD_TEMPLATE_SPEC = obj({"metadata": OBJECT_META, "spec": POD_SPEC}, required=["spec"])

# --- batch/v1
POD_FAILURE_POLICY = obj(
  {
    "rules": array(
      obj(
        {
          "action": {"enum": ["FailJob", "FailIndex", "Ignore", "Count"]},
          "onExitCodes": obj(
            {
              "containerName": DNS_LABEL,
              "operator": {"enum": ["In", "NotIn"]},
              "values": array(INTEGER, min_items=1),
            },
            required=["operator", "values"],
          ),
          "onPodConditions": array(obj({"type": STRING, "status": STRING}, required=["type"])),
        },
        required=["action"],
        exactly_one_of=["onExitCodes", "onPodConditions"],
      ),
      min_items=1,
    )
  },
  required=["rules"],
)
JOB_SPEC = obj(
  {
    "parallelism": NON_NEGATIVE,
    "completions": NON_NEGATIVE,
    "completionMode": {"enum": ["NonIndexed", "Indexed"]},
    "backoffLimit": NON_NEGATIVE,
    "podFailurePolicy": POD_FAILURE_POLICY,
    "activeDeadlineSeconds": POSITIVE,
    "ttlSecondsAfterFinished": NON_NEGATIVE,
    "suspend": BOOLEAN,
    "template": POD_TEMPLATE_SPEC,
  },
  required=["template"],
)
JOB_TEMPLATE_SPEC = obj({"metadata": OBJECT_META, "spec": JOB_SPEC}, required=["spec"])

# --- jobset.x-k8s.io/v1alpha2 (sigs.k8s.io/jobset api/jobset/v1alpha2/jobset_types.go)
REPLICATED_JOB = obj(
  {
    "name": DNS_LABEL,
    "groupName": DNS_LABEL,
    "replicas": NON_NEGATIVE,
    "template": JOB_TEMPLATE_SPEC,
    "dependsOn": array(
      obj({"name": DNS_LABEL, "status": {"enum": ["Ready", "Complete"]}}, required=["name"])
    ),
  },
  required=["name", "template"],
)
FAILURE_POLICY = obj(
  {
    "maxRestarts": NON_NEGATIVE,
    "restartStrategy": {"enum": ["Recreate", "BlockingRecreate", "InPlaceRestart"]},
    "rules": array(
      obj(
        {
          "name": {"type": "string", "pattern": r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?"},
          "action": {
            "enum": [
              "FailJobSet",
              "RestartJobSet",
              "RestartJobSetAndIgnoreMaxRestarts",
              "RestartJob",
              "RestartJobAndIgnoreMaxRestarts",
            ]
          },
          "onJobFailureReasons": STRINGS,
          "onJobFailureMessagePatterns": STRINGS,
          "targetReplicatedJobs": STRINGS,
        },
        required=["name", "action"],
      )
    ),
  }
)
JOBSET_SPEC = obj(
  {
    "replicatedJobs": array(REPLICATED_JOB, min_items=1),
    "network": obj(
      {"enableDNSHostnames": BOOLEAN, "subdomain": DNS_LABEL, "publishNotReadyAddresses": BOOLEAN}
    ),
    "successPolicy": obj(
      {"operator": {"enum": ["All", "Any"]}, "targetReplicatedJobs": STRINGS}, required=["operator"]
    ),
    "failurePolicy": FAILURE_POLICY,
    "startupPolicy": obj(
      {"startupPolicyOrder": {"enum": ["AnyOrder", "InOrder"]}}, required=["startupPolicyOrder"]
    ),
    "coordinator": obj(
      {"replicatedJob": DNS_LABEL, "jobIndex": NON_NEGATIVE, "podIndex": NON_NEGATIVE},
      required=["replicatedJob"],
    ),
    "suspend": BOOLEAN,
    "ttlSecondsAfterFinished": NON_NEGATIVE,
  },
  required=["replicatedJobs"],
)
JOBSET = obj(
  {
    "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
    "kind": {"const": "JobSet"},
    "metadata": OBJECT_META,
    "spec": JOBSET_SPEC,
  },
  required=["apiVersion", "kind", "metadata", "spec"],
)

# --- core/v1 Service
SERVICE = obj(
  {
    "apiVersion": {"const": "v1"},
    "kind": {"const": "Service"},
    "metadata": OBJECT_META,
    "spec": obj(
      {
        "clusterIP": STRING,  # "None" makes it headless: DNS names for pods, no load balancing.
        "selector": STRING_MAP,
        "publishNotReadyAddresses": BOOLEAN,
        "ports": array(
          obj(
            {
              "name": DNS_LABEL,
              "port": {"type": "integer", "minimum": 1, "maximum": 65535},
              "targetPort": {"type": ["integer", "string"]},
              "protocol": {"enum": ["TCP", "UDP", "SCTP"]},
            },
            required=["port"],
          )
        ),
      }
    ),
  },
  required=["apiVersion", "kind", "metadata", "spec"],
)

# --- networking.k8s.io/v1 NetworkPolicy (ingress only)
LABEL_SELECTOR = obj({"matchLabels": STRING_MAP})
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
NETWORK_POLICY_PORT = obj({"protocol": {"enum": ["TCP", "UDP", "SCTP"]}, "port": _PORT, "endPort": _PORT})
NETWORK_POLICY_PEER = obj({"podSelector": LABEL_SELECTOR, "namespaceSelector": LABEL_SELECTOR})
NETWORK_POLICY = obj(
  {
    "apiVersion": {"const": "networking.k8s.io/v1"},
    "kind": {"const": "NetworkPolicy"},
    "metadata": OBJECT_META,
    "spec": obj(
      {
        "podSelector": LABEL_SELECTOR,  # The pods it applies to.
        "policyTypes": array({"enum": ["Ingress", "Egress"]}),
        # Each rule admits traffic from all of its peers (every source when there is no `from`) to its ports.
        "ingress": array(obj({"from": array(NETWORK_POLICY_PEER), "ports": array(NETWORK_POLICY_PORT)})),
      },
      required=["podSelector"],
    ),
  },
  required=["apiVersion", "kind", "metadata", "spec"],
)

SCHEMAS = {
  ("jobset.x-k8s.io/v1alpha2", "JobSet"): JOBSET,
  ("v1", "Service"): SERVICE,
  ("networking.k8s.io/v1", "NetworkPolicy"): NETWORK_POLICY,
}

_TYPES = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool}


def _is(value, type_name: str) -> bool:
  if type_name == "integer" and isinstance(value, bool):
    return False  # bool is an int in Python, not in the API.
  return isinstance(value, _TYPES[type_name])


def validate(value, schema: dict, path: str = "$") -> list[str]:
  """Every violation of `schema` in `value`, each as 'PATH: what is wrong'; [] when it conforms."""
  if "const" in schema and value != schema["const"]:
    return [f"{path}: must be {schema['const']!r}, got {value!r}"]
  if "enum" in schema and value not in schema["enum"]:
    return [f"{path}: must be one of {schema['enum']}, got {value!r}"]
  types = schema.get("type")
  if types is not None:
    types = [types] if isinstance(types, str) else types
    if not any(_is(value, t) for t in types):
      return [f"{path}: must be {' or '.join(types)}, got {type(value).__name__} {value!r}"]
  errors = []
  if isinstance(value, str):
    if "pattern" in schema and not re.fullmatch(schema["pattern"], value):
      errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if "max_length" in schema and len(value) > schema["max_length"]:
      errors.append(f"{path}: {value!r} is longer than {schema['max_length']} characters")
  if _is(value, "integer"):
    if "minimum" in schema and value < schema["minimum"]:
      errors.append(f"{path}: {value} is below the minimum {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
      errors.append(f"{path}: {value} is above the maximum {schema['maximum']}")
  if isinstance(value, list):
    if len(value) < schema.get("min_items", 0):
      errors.append(f"{path}: needs at least {schema['min_items']} item(s)")
    if "items" in schema:
      for i, item in enumerate(value):
        errors += validate(item, schema["items"], f"{path}[{i}]")
  if isinstance(value, dict):
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key in schema.get("required", ()):
      if key not in value:
        errors.append(f"{path}: missing required field {key!r}")
    present = lambda keys: [k for k in keys if k in value]
    if "exactly_one_of" in schema and len(present(schema["exactly_one_of"])) != 1:
      errors.append(
        f"{path}: needs exactly one of {schema['exactly_one_of']}, got {present(schema['exactly_one_of'])}"
      )
    if "at_most_one_of" in schema and len(present(schema["at_most_one_of"])) > 1:
      errors.append(
        f"{path}: at most one of {schema['at_most_one_of']}, got {present(schema['at_most_one_of'])}"
      )
    for key, item in value.items():
      if not isinstance(key, str):
        errors.append(f"{path}: key {key!r} is not a string")
      elif key in properties:
        errors += validate(item, properties[key], f"{path}.{key}")
      elif extra is False:
        errors.append(f"{path}: unknown field {key!r} (known: {', '.join(sorted(properties))})")
      elif isinstance(extra, dict):
        errors += validate(item, extra, f"{path}[{key!r}]")
  return errors


def validate_object(manifest: dict) -> list[str]:
  """Validates one Kubernetes object against the schema its apiVersion and kind select."""
  if not isinstance(manifest, dict):
    return [f"$: an object must be a mapping, got {type(manifest).__name__}"]
  key = (manifest.get("apiVersion"), manifest.get("kind"))
  if key not in SCHEMAS:
    return [f"$: no schema for apiVersion={key[0]!r} kind={key[1]!r} (known: {sorted(SCHEMAS)})"]
  name = (manifest.get("metadata") or {}).get("name", "?")
  return [f"{key[1]}/{name} {error}" for error in validate(manifest, SCHEMAS[key])]
