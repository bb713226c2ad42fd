"""Kubernetes: launch/k8s/render.py writes the JobSet manifest (the GPU variant from gpu_jobset.py, the
Pathways one from pathways_jobset.py, the pieces both share from common.py); schema.py validates it
against the Kubernetes schemas (kubernetes-validate), the JobSet schema in vendor/ and api_rules.py."""
