"""Ready environments, usable as ``--env envs.NAME:Class``."""

from agentrl.registry import register

register("agentrl/Calculator-v0", "envs.calculator:Calculator")
register("agentrl/Digits-v0", "envs.digits:Digits")
register("agentrl/Countdown-v0", "envs.countdown:Countdown")
register("agentrl/Wordle-v0", "envs.wordle:Wordle")
register("agentrl/SearchQA-v0", "envs.search_qa:SearchQA")
register("agentrl/PythonCode-v0", "envs.python_code:PythonCode")
register("agentrl/GSM8K-v0", "envs.gsm8k:GSM8K")
