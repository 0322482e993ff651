"""agentrl: an environment-centric SDK for agentic RL of LLMs.

Write an environment (:class:`Env`, or :class:`ToolEnv` with :func:`tool` functions); the SDK's
generate loop drives token-exact multi-turn episodes against SGLang-compatible engines and hands
out :class:`Sample` records with loss masks, rollout log-probs and per-turn rewards;
:func:`train` (``agentrl train``) runs GRPO-family training on them with a :class:`RunConfig`.
"""

from agentrl.check import check_env
from agentrl.config import RolloutConfig, RunConfig, TrainConfig
from agentrl.env import Env, ToolEnv, load_env, make, register
from agentrl.tool import Tool, ToolError, ToolResult, tool
from agentrl.runtime.train import train
from agentrl.types import Action, Message, ParseError, Sample, Status, ToolCall


__all__ = [
    "Action",
    "Env",
    "Message",
    "ParseError",
    "RolloutConfig",
    "RunConfig",
    "Sample",
    "Status",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolError",
    "ToolResult",
    "TrainConfig",
    "check_env",
    "load_env",
    "make",
    "register",
    "tool",
    "train",
]

__version__ = "0.1.0"
