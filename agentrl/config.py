"""Run configuration: one dataclass tree, with slime's flag names where the concept is the same.

``--rollout-max-response-len`` is the per-turn generation budget (slime sends it as
``max_new_tokens`` on every generate call); ``--rollout-max-context-len`` caps the whole episode
(prompt + every turn + every observation): an episode that would pass it ends as ``truncated``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentrl.engines.base import SamplingParams


@dataclass
class RolloutConfig:
    """Everything that shapes how episodes are generated."""

    n_samples_per_prompt: int = 1
    max_turns: int = 4
    rollout_max_response_len: int = 256
    rollout_max_context_len: int | None = None
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    rollout_stop: list[str] = field(default_factory=list)
    rollout_stop_token_ids: list[int] = field(default_factory=list)
    rollout_seed: int = 42
    rollout_concurrency: int = 64
    env_step_timeout: float = 60.0
    input_key: str = "prompt"
    label_key: str = "label"
    tool_parser: str | None = None
    tool_template: str = "auto"

    def validate(self) -> None:
        """Refuse a bad configuration before any work starts, naming the flag to change."""
        checks = [
            (self.n_samples_per_prompt >= 1, "--n-samples-per-prompt must be >= 1"),
            (self.max_turns >= 1, "--max-turns must be >= 1"),
            (self.rollout_max_response_len >= 1, "--rollout-max-response-len must be >= 1"),
            (self.rollout_max_context_len is None or self.rollout_max_context_len >= 2,
             "--rollout-max-context-len must be >= 2"),
            (self.rollout_temperature >= 0, "--rollout-temperature must be >= 0"),
            (0 < self.rollout_top_p <= 1, "--rollout-top-p must be in (0, 1]"),
            (self.rollout_top_k == -1 or self.rollout_top_k >= 1, "--rollout-top-k must be -1 (off) or >= 1"),
            (self.rollout_concurrency >= 1, "--rollout-concurrency must be >= 1"),
            (self.env_step_timeout > 0, "--env-step-timeout must be > 0"),
            (self.tool_template in ("auto", "native", "builtin"), "--tool-template must be auto, native or builtin"),
        ]
        problems = [msg for ok, msg in checks if not ok]
        if problems:
            raise ValueError("bad configuration: " + "; ".join(problems))

    def sampling(self, max_new_tokens: int | None = None) -> SamplingParams:
        """The sampling params of one generate call."""
        return SamplingParams(
            max_new_tokens=max_new_tokens or self.rollout_max_response_len,
            temperature=self.rollout_temperature,
            top_p=self.rollout_top_p,
            top_k=self.rollout_top_k,
            stop=list(self.rollout_stop),
            stop_token_ids=list(self.rollout_stop_token_ids),
        )
