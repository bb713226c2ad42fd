"""The integrity checks: does XLA partition the step right (first_step), do replicas stay equal
(replicas), does a device compute what another computes (recompute), when they run (integrity), and how
two computations of the same thing are compared (compare, also verify's)."""
