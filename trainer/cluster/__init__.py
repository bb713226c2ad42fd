"""Running on many processes: runtime set-up, agreement, liveness, watchdog, signals, failures and
recovery (the integrity checks are trainer/checks/)."""
