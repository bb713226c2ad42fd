"""Kubernetes: launch/k8s/render.py writes the JobSet manifest (the Pathways variant from pathways_jobset.py,
the pieces both share from common.py); schema.py validates it."""
