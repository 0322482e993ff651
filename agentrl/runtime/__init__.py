"""Ray runtime: actor groups, engines, weight sync, the train loop, data buffer, checkpoints."""
