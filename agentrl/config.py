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


ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo")


@dataclass
class TrainConfig:
    """Everything that shapes one policy update (slime's flag names).

    ``global_batch_size`` samples make one optimizer step; a rollout of ``rollout_batch_size *
    n_samples_per_prompt`` samples gives ``num_steps_per_rollout`` steps. Micro-batches are packed
    by a token budget (``max_tokens_per_gpu``), never padded to the longest sample.
    """

    advantage_estimator: str = "grpo"
    disable_grpo_std_normalization: bool = False
    gamma: float = 1.0
    per_turn_credit: bool = False
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    clip_grad: float = 1.0
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    calculate_per_token_loss: bool = False
    use_tis: bool = False
    tis_threshold: float = 2.0
    global_batch_size: int = 8
    num_steps_per_rollout: int = 1
    max_tokens_per_gpu: int = 4096
    gradient_checkpointing: bool = False
    dtype: str = "auto"
    seed: int = 1234

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    def validate(self) -> None:
        """Refuse a bad configuration before any work starts, naming the flag to change."""
        checks = [
            (self.advantage_estimator in ADVANTAGE_ESTIMATORS,
             f"--advantage-estimator must be one of {', '.join(ADVANTAGE_ESTIMATORS)}"),
            (0.0 <= self.gamma <= 1.0, "--gamma must be in [0, 1]"),
            (self.lr > 0, "--lr must be > 0"),
            (self.eps_clip > 0 and self.clip_high > 0, "--eps-clip and --eps-clip-high must be > 0"),
            (self.kl_loss_type in ("k1", "k2", "k3"), "--kl-loss-type must be k1, k2 or k3"),
            (self.kl_loss_coef >= 0 and self.kl_coef >= 0, "--kl-loss-coef and --kl-coef must be >= 0"),
            (self.tis_threshold >= 1.0, "--tis-threshold must be >= 1"),
            (self.global_batch_size >= 1, "--global-batch-size must be >= 1"),
            (self.num_steps_per_rollout >= 1, "--num-steps-per-rollout must be >= 1"),
            (self.max_tokens_per_gpu >= 16, "--max-tokens-per-gpu must be >= 16"),
            (self.dtype in ("auto", "float32", "bfloat16", "float16"), "--dtype must be auto, float32, bfloat16 or float16"),
            (self.clip_grad >= 0, "--clip-grad must be >= 0 (0 = off)"),
        ]
        problems = [msg for ok, msg in checks if not ok]
        if problems:
            raise ValueError("bad configuration: " + "; ".join(problems))
