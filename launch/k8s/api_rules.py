"""What the API server checks beyond the published schemas, for the kinds launch/k8s/render.py emits: data
(JSON Schema, draft 2020-12) that launch/k8s/schema.py checks every rendered object against.

The Kubernetes OpenAPI schemas (kubernetes-validate ships them) and the JobSet CRD schema
(launch/k8s/vendor/) give each field's type, the required ones and, strict, every field that exists;
they say nothing of what the API server's validation code (validation.go, JobSet's webhook) also
rejects: names that are no DNS label, an environment variable name it refuses, a quantity that does not
parse, an enum value it does not know, a negative count, a volume with two sources, a container
without an image, `restartPolicy` on a container that is not an init container. The rules below say
those for the fields the renderer writes, and a few neighbours a user might add; kubectl would only
find them out on the cluster. Each rule mirrors the object's layout: RULES["$defs"][KIND] is the
entry point for a kind (schema.py looks it up by kind).

Patterns are Python regular expressions, as `jsonschema` runs them (re.search): anchored with ^ and \\Z,
because $ also matches before a final newline. A `$comment` is the rule in words: schema.py shows it
with the error.
"""

# RFC 1123 label: names of objects, containers, volumes and ports; at most 63 characters.
DNS_LABEL = {
  "type": "string",
  "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z",
  "maxLength": 63,
  "$comment": "an RFC 1123 label: lower-case letters, digits and '-', at most 63 characters",
}
# RFC 1123 subdomain: claim names may contain dots.
DNS_SUBDOMAIN = {
  "type": "string",
  "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?\Z",
  "maxLength": 253,
  "$comment": "an RFC 1123 subdomain: lower-case letters, digits, '-' and '.', at most 253 characters",
}
# A resource quantity, "8", 8, "16Gi", "500m", "1e3": the pattern Kubernetes' CRD generator writes for one.
_NUMBER = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
QUANTITY = {
  "pattern": rf"^(\+|-)?{_NUMBER}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{_NUMBER}))?\Z",
  "$comment": "a quantity: a number with an optional suffix such as m, Mi or Gi",
}
NON_NEGATIVE = {"minimum": 0}
PORT = {"minimum": 1, "maximum": 65535}
# A port given by name (an IntOrString field holding a string): an IANA service name.
PORT_NAME = {
  "pattern": r"^(?=.*[a-z])(?!.*--)[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z",
  "maxLength": 15,
  "$comment": "a port name: at most 15 lower-case letters, digits and '-', with a letter, no '--'",
}
PROTOCOL = {"enum": ["TCP", "UDP", "SCTP"]}
# What every object of these kinds has; the schemas leave each of them optional.
TOP_LEVEL = ("apiVersion", "kind", "metadata", "spec")
REF = lambda name: {"$ref": f"#/$defs/{name}"}

_CONTAINER = {
  "required": ["image"],  # The API leaves it to higher-level controllers; a pod cannot start without.
  "properties": {
    "name": DNS_LABEL,
    "image": {"type": "string", "pattern": r"^\S+\Z", "$comment": "an image name, without whitespace"},
    "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    "env": {"items": REF("EnvVar")},
    "ports": {
      "items": {
        "properties": {"name": DNS_LABEL, "containerPort": PORT, "hostPort": PORT, "protocol": PROTOCOL}
      }
    },
    "resources": {
      "properties": {
        "limits": {"additionalProperties": QUANTITY},
        "requests": {"additionalProperties": QUANTITY},
      }
    },
    "volumeMounts": {"items": {"properties": {"name": DNS_LABEL}}},
  },
}

_DEFS = {
  "ObjectMeta": {"properties": {"name": DNS_LABEL, "namespace": DNS_LABEL}},
  "EnvVar": {
    "properties": {
      "name": {
        "pattern": r"^[-._a-zA-Z][-._a-zA-Z0-9]*\Z",
        "$comment": "letters, digits, '_', '-' and '.', not starting with a digit",
      },
      "valueFrom": {"minProperties": 1, "maxProperties": 1, "$comment": "exactly one source of the value"},
    },
    "not": {"required": ["value", "valueFrom"]},
    "$comment": "value or valueFrom, not both (neither: the empty string)",
  },
  # A regular container may not have restartPolicy; an init container's `Always` makes it a sidecar that
  # runs beside the main containers (Kubernetes >= 1.29).
  "Container": {
    **_CONTAINER,
    "allOf": [
      {"not": {"required": ["restartPolicy"]}, "$comment": "only an init container may set restartPolicy"},
    ],
  },
  "InitContainer": {
    **_CONTAINER,
    "properties": {**_CONTAINER["properties"], "restartPolicy": {"enum": ["Always"]}},
  },
  "Volume": {
    "properties": {
      "name": DNS_LABEL,
      "persistentVolumeClaim": {"properties": {"claimName": DNS_SUBDOMAIN}},
      "emptyDir": {"properties": {"medium": {"enum": ["", "Memory"]}, "sizeLimit": QUANTITY}},
      "hostPath": {
        "properties": {"type": {"enum": ["", "DirectoryOrCreate", "Directory", "FileOrCreate", "File"]}}
      },
    },
    # The schema requires its name; every other field is a source.
    "minProperties": 2,
    "maxProperties": 2,
    "$comment": "a volume has a name and exactly one source",
  },
  "PodSpec": {
    "required": ["containers"],
    "properties": {
      "containers": {"minItems": 1, "items": REF("Container")},
      "initContainers": {"items": REF("InitContainer")},
      "volumes": {"items": REF("Volume")},
      "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]},
      "subdomain": DNS_LABEL,
      "hostname": DNS_LABEL,
      "dnsPolicy": {"enum": ["ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"]},
      "terminationGracePeriodSeconds": NON_NEGATIVE,
      "serviceAccountName": DNS_SUBDOMAIN,
      "tolerations": {
        "items": {
          "properties": {
            "operator": {"enum": ["Exists", "Equal"]},
            "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
          }
        }
      },
    },
  },
  "PodTemplateSpec": {
    "required": ["spec"],
    "properties": {"metadata": REF("ObjectMeta"), "spec": REF("PodSpec")},
  },
  "PodFailurePolicyRule": {
    "properties": {
      "action": {"enum": ["FailJob", "FailIndex", "Ignore", "Count"]},
      "onExitCodes": {
        "required": ["operator", "values"],
        "properties": {
          "containerName": DNS_LABEL,
          "operator": {"enum": ["In", "NotIn"]},
          "values": {"minItems": 1},
        },
      },
    },
    "oneOf": [{"required": ["onExitCodes"]}, {"required": ["onPodConditions"]}],
    "$comment": "a rule matches on exit codes or on pod conditions: one of onExitCodes, onPodConditions",
  },
  "JobSpec": {
    "required": ["template"],
    "properties": {
      "parallelism": NON_NEGATIVE,
      "completions": NON_NEGATIVE,
      "completionMode": {"enum": ["NonIndexed", "Indexed"]},
      "backoffLimit": NON_NEGATIVE,
      "activeDeadlineSeconds": {"minimum": 1},
      "ttlSecondsAfterFinished": NON_NEGATIVE,
      "podFailurePolicy": {
        "required": ["rules"],
        "properties": {"rules": {"minItems": 1, "items": REF("PodFailurePolicyRule")}},
      },
      "template": REF("PodTemplateSpec"),
    },
  },
  "JobTemplateSpec": {
    "required": ["spec"],
    "properties": {"metadata": REF("ObjectMeta"), "spec": REF("JobSpec")},
  },
  # --- The kinds.
  "JobSet": {
    "required": list(TOP_LEVEL),
    "properties": {
      "metadata": REF("ObjectMeta"),
      "spec": {
        "required": ["replicatedJobs"],
        "properties": {
          "replicatedJobs": {
            "minItems": 1,
            "items": {
              "properties": {
                "name": DNS_LABEL,
                "groupName": DNS_LABEL,
                "replicas": NON_NEGATIVE,
                "template": REF("JobTemplateSpec"),
                "dependsOn": {"items": {"properties": {"name": DNS_LABEL}}},
              }
            },
          },
          "network": {"properties": {"subdomain": DNS_LABEL}},
          "failurePolicy": {
            "properties": {
              "maxRestarts": NON_NEGATIVE,
              "rules": {
                "items": {"properties": {"name": {"pattern": r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?\Z"}}}
              },
            }
          },
          "coordinator": {
            "properties": {"replicatedJob": DNS_LABEL, "jobIndex": NON_NEGATIVE, "podIndex": NON_NEGATIVE}
          },
          "ttlSecondsAfterFinished": NON_NEGATIVE,
        },
      },
    },
  },
  "Service": {
    "required": list(TOP_LEVEL),
    "properties": {
      "metadata": REF("ObjectMeta"),
      "spec": {
        "properties": {
          "ports": {"items": {"properties": {"name": DNS_LABEL, "port": PORT, "protocol": PROTOCOL}}},
        }
      },
    },
  },
  "Secret": {
    "required": ["apiVersion", "kind", "metadata", "stringData"],
    "properties": {"metadata": REF("ObjectMeta")},
  },
  "NetworkPolicy": {
    "required": list(TOP_LEVEL),
    "properties": {
      "metadata": REF("ObjectMeta"),
      "spec": {
        "required": ["podSelector"],  # The pods it applies to ({}: every pod of the namespace).
        "properties": {
          "policyTypes": {"items": {"enum": ["Ingress", "Egress"]}},
          # A rule admits traffic from all of its peers (every source when there is no `from`) to its ports.
          "ingress": {
            "items": {
              "properties": {
                "ports": {
                  "items": {
                    "properties": {
                      "protocol": PROTOCOL,
                      "port": {**PORT, "if": {"type": "string"}, "then": PORT_NAME},
                      "endPort": PORT,
                    }
                  }
                }
              }
            }
          },
        },
      },
    },
  },
}

RULES = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": _DEFS}
