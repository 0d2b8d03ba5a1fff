"""Step costs per machine: the fingerprint, the probe, the cost table, its cache, and re-ranking."""
