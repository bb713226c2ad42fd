"""The modes besides training: verify, inspect, export."""
