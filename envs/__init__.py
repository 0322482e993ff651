"""Ready environments, usable as ``--env envs.NAME:Class``."""
