"""Writes jobset-v1alpha2.json beside this file from the JobSet CRD of a JobSet release.

  git -C JOBSET show v0.12.0:config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml > /tmp/crd.yaml
  python launch/k8s/vendor/vendor_jobset.py /tmp/crd.yaml v0.12.0

JOBSET is a clone of github.com/kubernetes-sigs/jobset. Run it again (and the rendering tests) to move
to a newer release. The CRD's openAPIV3Schema becomes a JSON Schema (draft 2020-12) that
launch/k8s/schema.py checks with `jsonschema`, by these mechanical steps only:

- The Job template of a replicated job, which the CRD copies in full, and the object metadata, which
  it leaves untyped, refer to the Kubernetes definitions kubernetes-validate ships instead
  (io.k8s.api.batch.v1.JobTemplateSpec, ObjectMeta): one copy of the Job and Pod schemas, the
  maintained one, for the JobSet and the core kinds alike.
- Strict, as kubernetes-validate's strict schemas are: every object that lists its properties rejects
  others (additionalProperties: false). The API server would drop an unknown field without a word;
  a misspelt one is what this should catch.
- apiVersion and kind take the one value each, `status` goes (a manifest has none), and what is not
  JSON Schema goes too: descriptions and the x-kubernetes-* extensions (the CEL rules among them,
  which only a cluster evaluates).
"""

import json
import os
import sys

import yaml

K8S_DEFINITIONS = "https://kubernetes.io/api/_definitions.json#/$defs/"
KEEP = {
  "type",
  "properties",
  "required",
  "items",
  "enum",
  "format",
  "default",
  "minimum",
  "maximum",
  "minItems",
  "maxItems",
  "minLength",
  "maxLength",
  "pattern",
  "additionalProperties",
  "anyOf",
  "oneOf",
  "allOf",
  "not",
}


def _strict(schema):
  if isinstance(schema, list):
    return [_strict(s) for s in schema]
  if not isinstance(schema, dict):
    return schema
  out = {
    k: _strict(v) if k != "properties" else {p: _strict(s) for p, s in v.items()} for k, v in schema.items()
  }
  out = {k: v for k, v in out.items() if k in KEEP or k == "$ref"}
  if "properties" in out and "additionalProperties" not in out:
    out["additionalProperties"] = False
  return out


def convert(crd: dict, release: str) -> dict:
  [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
  schema = version["schema"]["openAPIV3Schema"]
  top = schema["properties"]
  del top["status"]
  top["metadata"] = {"$ref": K8S_DEFINITIONS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
  replicated_job = top["spec"]["properties"]["replicatedJobs"]["items"]
  replicated_job["properties"]["template"] = {"$ref": K8S_DEFINITIONS + "io.k8s.api.batch.v1.JobTemplateSpec"}
  out = _strict(schema)
  out["properties"]["apiVersion"]["enum"] = ["jobset.x-k8s.io/v1alpha2"]
  out["properties"]["kind"]["enum"] = ["JobSet"]
  return {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://jobset.sigs.k8s.io/api/jobset-v1alpha2.json",
    "$comment": f"JobSet {release}, {crd['metadata']['name']}, by launch/k8s/vendor/vendor_jobset.py",
    **out,
  }


if __name__ == "__main__":
  crd_path, release = sys.argv[1:3]
  with open(crd_path) as f:
    crd = yaml.safe_load(f)
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobset-v1alpha2.json")
  with open(path, "w") as f:
    json.dump(convert(crd, release), f, indent=2)
    f.write("\n")
  print(f"wrote {path}")
