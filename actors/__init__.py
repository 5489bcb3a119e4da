"""Ray actors that place the engine of `pipeline` on devices (shards, profilers, coordinators)."""
