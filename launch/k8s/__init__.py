"""Kubernetes: launch/k8s/render.py writes the JobSet manifest; schema.py validates it."""
