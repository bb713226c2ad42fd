"""Running on many processes: runtime set-up, agreement, liveness, watchdog, signals, integrity checks."""
