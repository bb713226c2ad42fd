"""SLURM: the batch script for clusters and a local single-node cluster for its tests."""
