"""What a run reports: metrics, goodput, profiles, collectives, FLOPs, stragglers, the report CLI."""
