"""Ready environments, usable as ``--env envs.NAME:Class``."""

from agentrl.env import register

register("agentrl/Calculator-v0", "envs.calculator:Calculator")
register("agentrl/Digits-v0", "envs.digits:Digits")
