"""Orbax checkpoints: saving, restoring, proving damage, rolling back; export reads through it."""
