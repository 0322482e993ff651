"""agentrl: an environment-centric SDK for agentic RL of LLMs.

Write an environment (:class:`Env`, or :class:`ToolEnv` with :func:`tool` functions); the SDK's
generate loop drives token-exact multi-turn episodes against SGLang-compatible engines and hands
out :class:`Sample` records with loss masks, rollout log-probs and per-turn rewards;
:func:`train` (``agentrl train``) runs GRPO-family or PPO training on them with a :class:`RunConfig`,
after :func:`preflight` (every check of the run, before anything starts) resolved it into a :class:`ResolvedRun`.
Model-written code runs in a :class:`Sandbox` (:func:`create_sandbox`); environments of other
frameworks run unchanged through :class:`GymnasiumEnv` and :class:`OpenEnvEnv`; :func:`play`
runs an env with a scripted policy. Tools, agents and envs made elsewhere come in through
:func:`mcp_tools` (a Model Context Protocol server's tools, :class:`MCPToolEnv`), :class:`ProxyEnv` (an
unmodified agent program written against the OpenAI API, recorded token-exact) and go out through
:class:`EnvServer` (``agentrl env-serve``: any env over OpenEnv's protocol). Warm starts (``agentrl sft``) train on demonstrations made
token-exact by :func:`conversation_samples` (OpenAI-format conversations, read by :func:`read_rows`),
:func:`scripted_samples` (a scripted policy) or :func:`rejection_samples` (an engine's best episodes).
Observations may hold pictures (OpenAI image content parts or PIL images, checked by :func:`load_image`,
refused with :class:`ImageError`) for a vision-language policy (:func:`vision_for` its :class:`VisionFamily`).

The scale path is imported on first use (it pulls in megatron-core and Ray): the trainer backends
:class:`TorchTrainer` and :class:`MegatronTrainer` (one rank each, the :class:`Trainer` contract),
ppo's value models :class:`TorchCritic` and :class:`MegatronCritic` (the :class:`Critic` contract), and :class:`SGLangLaunch` / :class:`SGLangEngineGroup` (SGLang servers as Ray actors).
The train loop's parts, for assembling a loop by hand: :class:`TrainLoop` (the phases, in order) over a rollout
side (:class:`EpisodeCollector`, :class:`DemoCollector`), a :class:`Recipe` (:class:`PolicyGradient`, :class:`PPO`,
:class:`SFT`; :func:`recipe_for`), :class:`EngineHooks` and :class:`Observers`.
"""

from agentrl.adapters import GymnasiumEnv, OpenEnvEnv
from agentrl.check import check_env
from agentrl.config import RolloutConfig, RunConfig, TrainConfig
from agentrl.data import read_rows
from agentrl.env import Env, ToolEnv
from agentrl.images import ImageError, load_image
from agentrl.registry import load_env, make, register
from agentrl.rollout.demos import DemoError, DemoStats, conversation_samples, rejection_samples, scripted_samples
from agentrl.rollout.scripted import play
from agentrl.runtime.preflight import ResolvedRun, preflight
from agentrl.runtime.train import train
from agentrl.sandbox import ExecResult, Sandbox, SandboxConfig, create_sandbox
from agentrl.tool import Tool, ToolError, ToolResult, tool
from agentrl.types import Action, Message, ParseError, Sample, Status, ToolCall

__all__ = [
    "Action",
    "DemoError",
    "DemoStats",
    "Env",
    "ExecResult",
    "GymnasiumEnv",
    "ImageError",
    "Message",
    "OpenEnvEnv",
    "ParseError",
    "ResolvedRun",
    "RolloutConfig",
    "RunConfig",
    "Sample",
    "Sandbox",
    "SandboxConfig",
    "Status",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolError",
    "ToolResult",
    "TrainConfig",
    "check_env",
    "conversation_samples",
    "create_sandbox",
    "load_env",
    "load_image",
    "make",
    "play",
    "preflight",
    "read_rows",
    "register",
    "rejection_samples",
    "scripted_samples",
    "tool",
    "train",
]

_LAZY = {
    "VisionFamily": "agentrl.vlm",
    "vision_for": "agentrl.vlm",
    "Trainer": "agentrl.trainer.base",
    "TorchTrainer": "agentrl.trainer.torch_trainer",
    "MegatronTrainer": "agentrl.trainer.megatron_trainer",
    "MegatronParallel": "agentrl.trainer.megatron_trainer",
    "Critic": "agentrl.trainer.base",
    "TorchCritic": "agentrl.trainer.torch_critic",
    "MegatronCritic": "agentrl.trainer.megatron_critic",
    "SGLangLaunch": "agentrl.engines.sglang",
    "SGLangEngineGroup": "agentrl.runtime.engine_group",
    "TrainLoop": "agentrl.runtime.loop",
    "EngineHooks": "agentrl.runtime.loop",
    "Observers": "agentrl.runtime.loop",
    "EpisodeCollector": "agentrl.runtime.collect",
    "DemoCollector": "agentrl.runtime.collect",
    "PolicyGradient": "agentrl.runtime.recipes",
    "Recipe": "agentrl.runtime.recipes",
    "PPO": "agentrl.runtime.recipes",
    "SFT": "agentrl.runtime.recipes",
    "recipe_for": "agentrl.runtime.recipes",
    "mcp_tools": "agentrl.mcp",
    "MCPServerSpec": "agentrl.mcp",
    "MCPServerError": "agentrl.mcp",
    "MCPTool": "agentrl.mcp",
    "MCPToolEnv": "agentrl.mcp",
    "MCPToolset": "agentrl.mcp",
    "close_mcp_sessions": "agentrl.mcp",
    "ProxyEnv": "agentrl.proxy",
    "EnvServer": "agentrl.adapters.openenv_server",
}
__all__ += sorted(_LAZY)


def __getattr__(name: str):
    """Import the scale path and the ecosystem bridges only when asked for (``agentrl.MegatronTrainer``,
    ``agentrl.mcp_tools``): they pull in megatron-core, Ray, the ``mcp`` SDK or FastAPI."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agentrl' has no attribute {name!r}")


__version__ = "0.1.0"
