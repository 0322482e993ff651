"""Every check of a training run, once, before Ray or any engine starts; the run's derived values, once.

:func:`preflight` turns a :class:`~agentrl.config.RunConfig` into a :class:`ResolvedRun`: the configuration
with every derived value filled in (the trainer's logit temperature, optimizer steps per rollout, the run's length
from ``--num-epoch``, resolved checkpoint folders), read-only from then on, plus what the run loaded to check it (the env, its
task rows, eval sets, user functions, the resume point, SFT's demonstrations). :func:`~agentrl.runtime.train.train`
starts Ray, the engines and the trainer only from a ``ResolvedRun``, so a bad run fails here, with a message
naming the flag, before any model loads; and the caller's configuration object is never changed.

The checks, by concern, in order (cheap ones first; a model file is read only once everything else passed):

1. **values**: :meth:`RunConfig.problems <agentrl.config.RunConfig.problems>` (every flag's type, bounds and
   combinations, placement included; a bad rollout or train value is named with every other bad value of both) and :func:`~agentrl.runtime.backends.backend_problems` (what the chosen
   backends need from this machine), listed together in one error;
2. **data and rollout**: the env loads and the task rows parse (row code only behind ``--trust-row-code``), the
   chat template can render them, the eval sets parse, each rollout feature can be honoured by the episodes
   (:func:`~agentrl.rollout.generate.check_rollout_features`), ``--role-engine-url``'s engines answer for roles the
   env has, the user's functions load; the run's length
   (``--num-epoch``) and its optimizer steps per rollout are derived and checked, ``args`` built and checked to travel to rollout workers, the data
   source built;
3. **train**: the resume point (``--load`` never silently starts over), the policy and critic checkpoints (a
   saved critic is no policy, vocabularies match, a vision model's limits, an architecture megatron can
   express), SFT's demonstrations and the length they give.

``args`` is built from the configuration before the checkpoint folders are resolved (user functions see
``--hf-checkpoint`` as given). What only a started cluster can say stays where it is found: placement against Ray's resources
(:func:`~agentrl.runtime.cluster.plan_placement`), whether launched servers report routed experts.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl import sandbox
from agentrl.checkpoint import resolve_hf_checkpoint
from agentrl.config import DEFAULT_NUM_ROLLOUT, RunConfig, argparse_namespace, read_only, refuse, writable_copy
from agentrl.data import load_tasks, task_rows
from agentrl.flags import naming_flag
from agentrl.registry import load_env
from agentrl.rollout.generate import (
    BatchGenerate,
    check_apply_chat_template,
    check_role_engines,
    check_role_policies,
    check_rollout_features,
)
from agentrl.runtime import run_folder
from agentrl.runtime.backends import backend_problems
from agentrl.runtime.buffer import BufferedSource, DataSource, PromptSource, check_reward_nonzero_std
from agentrl.runtime.sft import load_demonstrations, sft_steps
from agentrl.types import Sample
from agentrl.user_code import load_function
from agentrl.vlm import is_vision_checkpoint, vision_for

__all__ = ["ResolvedRun", "check_values", "preflight"]


@dataclass(frozen=True)
class ResolvedRun:
    """A run that passed :func:`preflight`: its read-only configuration and what was loaded to check it.

    ``config`` is a resolved copy (derived values filled in) that refuses assignment; build a changed copy
    with :func:`dataclasses.replace` where a part needs one. ``rows`` are the training tasks (empty for a user
    data source or SFT data), ``source`` the prompt source an RL run draws from (None for SFT), ``demos`` SFT's
    demonstrations (None for RL), ``resume_from`` the ``iter_*`` checkpoint ``--load`` resumes (None: a new run).
    """

    config: RunConfig
    args: Any
    env_factory: Any
    rows: list[dict[str, Any]]
    eval_sets: dict[str, list[dict[str, Any]]]
    custom_generate: Any
    custom_rm: Any
    group_filter: Any
    sample_filter: Any
    source: Any
    checkpoint: Path
    resume_from: Path | None
    resume_step: int | None
    demos: list[Sample] | None


def preflight(cfg: RunConfig, args: Any = None) -> ResolvedRun:
    """Check ``cfg`` (values, data, rollout, train: see the module) and resolve it; raise before anything starts.

    ``args`` is what user functions receive (slime's ``args``); by default the resolved configuration as a
    flat namespace. ``cfg`` itself is not changed.
    """
    cfg = writable_copy(cfg)  # derived values go on the run's own copy
    check_values(cfg)
    sandbox.configure(cfg.rollout.sandbox_config())  # the episodes' sandboxed tools run in the driver
    # data and rollout
    factory, rows = _load_tasks(cfg)
    custom = bool(cfg.custom_generate_function_path or cfg.rollout_function_path)
    if not cfg.is_sft:
        check_apply_chat_template(cfg.rollout, custom=custom, rows=rows)
    eval_sets = _load_eval_sets(cfg)
    if not cfg.is_sft or cfg.demo_engine_url or eval_sets:  # what sampled episodes cannot honour
        check_rollout_features(cfg.rollout, [*rows, *(r for rows_ in eval_sets.values() for r in rows_)], custom=custom)
    if factory is None and cfg.train.policy:
        raise ValueError(
            "--policy: several policies play the roles of an env (--env with roles), not prompt rows alone"
        )
    if factory is not None and (cfg.rollout.role_engine_urls() or cfg.rollout.role_policies()):
        _check_role_engines(cfg, factory)  # the fixed opponents answer; every role is seated and exists
    fns = _load_functions(cfg)
    _derive_length(cfg, rows)
    args = args if args is not None else argparse_namespace(cfg)
    if cfg.rollout_num_workers > 1:  # each worker gets a pickled copy: refused now, not after the models load
        from agentrl.runtime.rollout_workers import check_worker_args

        check_worker_args(args)
    source = _data_source(cfg, rows, args) if not cfg.is_sft else None
    # train
    resume_from = _resume_point(cfg)
    checkpoint, critic = _check_checkpoints(cfg)
    if cfg.train.lora_rank or resume_from is not None:
        _check_adapters(cfg, checkpoint, resume_from)
    demos = _load_demos(cfg, factory, rows, checkpoint, resume_from) if cfg.is_sft else None
    cfg = _resolve(cfg, demos=demos, checkpoint=checkpoint, critic=critic)
    return ResolvedRun(
        config=cfg,
        args=args,
        env_factory=factory,
        rows=rows,
        eval_sets=eval_sets,
        custom_generate=fns["custom_generate"],
        custom_rm=fns["custom_rm"],
        group_filter=fns["group_filter"],
        sample_filter=fns["sample_filter"],
        source=source,
        checkpoint=checkpoint,
        resume_from=resume_from,
        resume_step=run_folder.read_loop_state(resume_from)["step"] if resume_from else None,
        demos=demos,
    )


# -- values -------------------------------------------------------------------------------------------


def check_values(cfg: RunConfig) -> None:
    """Every value's problem and every backend's, in one ``ValueError`` naming each flag (the first concern)."""
    sections = cfg.rollout.problems() + cfg.train.problems()  # the rest reads these values: alone when any is bad
    refuse(sections or cfg.problems() + backend_problems(cfg))


# -- data ---------------------------------------------------------------------------------------------


def _load_tasks(cfg: RunConfig) -> tuple[Any, list[dict[str, Any]]]:
    """The env factory and the training rows, parsed (a bad one names its flag)."""
    with naming_flag("--env", cfg.env):
        factory = load_env(cfg.env) if cfg.env else None
    # a user data source (--data-source-path) brings its own prompts, --sft-data its own conversations
    rows: list[dict[str, Any]] = []
    if not cfg.data_source_path and not cfg.sft_data and (factory is not None or cfg.prompt_data):
        with naming_flag("--prompt-data" if cfg.prompt_data else "--env", cfg.prompt_data or cfg.env):
            rows = task_rows(
                factory,
                cfg.prompt_data,
                input_key=cfg.rollout.input_key,
                label_key=cfg.rollout.label_key,
                env_name=cfg.env,
                trust_row_code=cfg.rollout.trust_row_code,
            )
    return factory, rows


def _load_eval_sets(cfg: RunConfig) -> dict[str, list[dict[str, Any]]]:
    """``--eval-prompt-data``'s sets by name, parsed (a bad file names its flag)."""
    eval_sets = {}
    for name, path in cfg.eval_prompt_data:
        with naming_flag("--eval-prompt-data", f"{name} {path}"):
            eval_sets[name] = load_tasks(
                path,
                input_key=cfg.rollout.input_key,
                label_key=cfg.rollout.label_key,
                trust_row_code=cfg.rollout.trust_row_code,
            )
    return eval_sets


# -- rollout ------------------------------------------------------------------------------------------


def _check_role_engines(cfg: RunConfig, factory: Any) -> None:
    """``--role-engine-url``: each engine answers ``/health`` and each role is one the env has."""
    from agentrl.rollout.context import role_engines  # the HTTP client: not for `import agentrl`

    async def check() -> None:
        engines = role_engines(cfg.rollout)
        try:
            await check_role_engines(dict(engines), factory)
            await check_role_policies(cfg.rollout, factory, every_role=bool(cfg.train.policy))
        finally:
            for engine in engines.values():
                await engine.close()

    asyncio.run(check())


def _load_functions(cfg: RunConfig) -> dict[str, Any]:
    """The user's functions, each loaded once here (a bad path names its flag)."""
    fns: dict[str, Any] = {"custom_generate": None, "custom_rm": None, "group_filter": None, "sample_filter": None}
    if cfg.custom_generate_function_path:
        fns["custom_generate"] = load_function(cfg.custom_generate_function_path)
    if cfg.rollout_function_path:
        with naming_flag("--rollout-function-path", cfg.rollout_function_path):
            fns["custom_generate"] = BatchGenerate.load(cfg.rollout_function_path)
    if cfg.custom_rm_path:
        fns["custom_rm"] = load_function(cfg.custom_rm_path)
    if cfg.dynamic_sampling_filter_path:
        fns["group_filter"] = (
            check_reward_nonzero_std
            if cfg.dynamic_sampling_filter_path == "default"
            else load_function(cfg.dynamic_sampling_filter_path)
        )
    if cfg.train.custom_loss_function_path:  # the trainer loads it again in its actor: a bad path stops here
        with naming_flag("--custom-loss-function-path", cfg.train.custom_loss_function_path):
            load_function(cfg.train.custom_loss_function_path)
    if cfg.rollout_sample_filter_path:
        with naming_flag("--rollout-sample-filter-path", cfg.rollout_sample_filter_path):
            fns["sample_filter"] = load_function(cfg.rollout_sample_filter_path)
    return fns


def _data_source(cfg: RunConfig, rows: list[dict[str, Any]], args: Any) -> Any:
    """Where an RL run's prompts come from: the task rows, or ``--data-source-path``; buffered when asked."""
    if cfg.data_source_path:
        source = load_function(cfg.data_source_path)(args)
        if not isinstance(source, DataSource):
            raise TypeError(
                f"--data-source-path {cfg.data_source_path} must build an object with "
                "get_samples(num_samples) and add_samples(samples)"
            )
    else:
        source = PromptSource(rows, shuffle=cfg.shuffle_prompts, seed=cfg.train.seed)
    if cfg.buffer_filter_path or cfg.dynamic_sampling_filter_path or cfg.async_mode:
        bf = load_function(cfg.buffer_filter_path) if cfg.buffer_filter_path else None
        source = BufferedSource(source, buffer_filter=bf, args=args, max_staleness=cfg.staleness_limit)
    return source


# -- train --------------------------------------------------------------------------------------------


def _resume_point(cfg: RunConfig) -> Path | None:
    """The checkpoint ``--load`` resumes from. A folder that holds a run but no complete checkpoint is
    refused (resuming must never silently start over); a missing or empty folder starts fresh, and says so."""
    if not cfg.load:
        return None
    if Path(cfg.load).exists() and not Path(cfg.load).is_dir():
        raise ValueError(f"--load {cfg.load} is a file; pass the run folder (the --save folder of the run to resume)")
    found = run_folder.latest_checkpoint(cfg.load)
    if found is not None:
        if run_folder.read_loop_state(found).get("loss_type", "policy_loss") != cfg.train.loss_type:
            raise ValueError(
                f"--load {cfg.load}: {found} was written by a {'warm start' if not cfg.is_sft else 'RL run'}"
                "; to start from its weights pass it as --hf-checkpoint instead"
            )
        run_folder.check_critic(found, cfg.train.advantage_estimator == "ppo")
        return found
    root = Path(cfg.load)
    if root.is_dir() and any(root.iterdir()):
        raise ValueError(
            f"--load {cfg.load}: the folder holds no complete checkpoint (iter_*/loop_state.json); "
            "pass the run folder that has one, or drop --load to start a new run elsewhere"
        )
    print(f"--load {cfg.load}: no checkpoint yet; starting from --hf-checkpoint", file=sys.stderr)
    return None


def _check_checkpoints(cfg: RunConfig) -> tuple[Path, Path | None]:
    """The policy's and the critic's checkpoint folders, resolved and checked as what each must be."""
    ckpt = resolve_hf_checkpoint(cfg.hf_checkpoint)
    _refuse_critic_checkpoint("--hf-checkpoint", ckpt, "a policy")
    _check_vision(cfg, ckpt)
    if cfg.train.lora_rank and not is_vision_checkpoint(ckpt):
        from agentrl.trainer.lora import check_lora  # torch and peft: not loaded by `import agentrl`

        check_lora(ckpt, cfg.train)  # the targets and rank against the model's layers (a meta-device model)
    critic = None
    if cfg.critic_hf_checkpoint:
        with naming_flag("--critic-hf-checkpoint", cfg.critic_hf_checkpoint):
            critic = resolve_hf_checkpoint(cfg.critic_hf_checkpoint)
            _refuse_critic_checkpoint("--critic-hf-checkpoint", critic, "an HF causal LM to start a critic from")
            _check_critic_vocab(ckpt, critic)
            if (critic / run_folder.CRITIC_DIR).is_dir():
                raise ValueError(
                    f"{critic} is a ppo run's checkpoint: its actor would start the new critic, not its critic. "
                    "Resume that run (actor and critic) with --load; a saved critic cannot start another run's"
                )
    if cfg.train_backend == "megatron":  # an architecture megatron cannot express is refused here
        from transformers import AutoConfig

        from agentrl.trainer.megatron_model import transformer_config_from_hf

        t = cfg.train
        for flag, model_path in (("--hf-checkpoint", ckpt), ("--critic-hf-checkpoint", critic)):
            if model_path is None:
                continue
            with naming_flag(flag, str(model_path)):
                transformer_config_from_hf(
                    AutoConfig.from_pretrained(str(model_path), local_files_only=True),
                    tp=t.tensor_model_parallel_size,
                    pp=t.pipeline_model_parallel_size,
                    cp=t.context_parallel_size,
                    overrides=dict(t.megatron_args),
                )
    return ckpt, critic


def _check_adapters(cfg: RunConfig, checkpoint: Path, resume_from: Path | None) -> None:
    """A LoRA run's adapters: the one it resumes and the one it starts from were trained on its base, with its
    rank and scale; a full run does not resume a LoRA run's checkpoint (nor the reverse)."""
    from agentrl.trainer.lora import check_adapter, check_resume  # torch and peft: not loaded by `import agentrl`

    if resume_from is not None:
        check_resume(resume_from, cfg.train, checkpoint, what=f"--load {cfg.load}", adapted=bool(cfg.train.lora_rank))
    if cfg.train.lora_adapter_path:
        path = cfg.train.lora_adapter_path
        check_adapter(Path(path), cfg.train, checkpoint, what=f"--lora-adapter-path {path}")


def _refuse_critic_checkpoint(flag: str, path: Path, wanted: str) -> None:
    """A saved critic (``iter_*/critic``: a value head, not an LM head) is not a model to start from."""
    config = json.loads((path / "config.json").read_text())
    if config.get("agentrl_value_head"):
        raise ValueError(
            f"{flag} {path}: a ppo run's saved critic (a value head), not {wanted}; "
            "a run's critic resumes with --load of its run folder"
        )


def _check_critic_vocab(policy: Path, critic: Path) -> None:
    """The critic reads the policy's token ids: both checkpoints must share a vocabulary."""
    a = json.loads((policy / "config.json").read_text()).get("vocab_size")
    b = json.loads((critic / "config.json").read_text()).get("vocab_size")
    if a != b:
        raise ValueError(
            f"its vocabulary ({b} ids) differs from the policy's ({a} ids, --hf-checkpoint {policy}); the critic "
            "scores the policy's tokens: start it from a model with the same tokenizer"
        )


def _check_vision(cfg: RunConfig, ckpt: Path) -> None:
    """A vision-language policy: refuse what cannot train it (names the flag); text models pass."""
    if not is_vision_checkpoint(ckpt):
        return
    vision_for(ckpt)  # an unsupported family (or a checkpoint without its processor) is refused here
    if cfg.train.lora_rank:
        raise ValueError(
            f"--lora-rank: {ckpt} is a vision-language model, and LoRA here adapts text-only causal LMs (the vision "
            "tower's and connector's layers are not wired in); drop --lora-rank"
        )
    if cfg.train_backend == "megatron":
        raise ValueError(
            f"--train-backend megatron: {ckpt} is a vision-language model, and agentrl's megatron backend builds "
            "text-only GPT models (megatron-core's multimodal LLaVA model is not wired in); use --train-backend torch"
        )
    if cfg.critic_hf_checkpoint or cfg.train.advantage_estimator == "ppo":
        raise ValueError(
            "a vision-language policy trains without a critic here: use a critic-free --advantage-estimator"
        )
    if cfg.trainer_world_size > 1:  # FSDP2 would shard the embeddings and vision tower the SDK calls before forward
        raise ValueError(
            f"a vision-language policy trains on one rank here (this run: {cfg.trainer_world_size}): set "
            "--trainer-num-procs 1 (on GPUs: --actor-num-nodes 1 --actor-num-gpus-per-node 1)"
        )


def _load_demos(
    cfg: RunConfig, factory: Any, rows: list[dict[str, Any]], checkpoint: Path, resume_from: Path | None
) -> list[Sample]:
    """SFT's demonstrations, loaded and checked (a bad row stops the run here); a resumed run reuses its own."""
    saved = resume_from.parent / "demos.jsonl" if resume_from is not None else None  # the run folder of iter_*
    if saved is not None and saved.is_file():  # a resumed warm start trains on the same demonstrations
        demos = [Sample.from_dict(json.loads(line)) for line in saved.open(encoding="utf-8")]
        print(f"demonstrations: {len(demos)} from {saved} (resuming)", file=sys.stderr)
        return demos
    return load_demonstrations(cfg, factory, rows, checkpoint)


# -- derived values -----------------------------------------------------------------------------------


def _derive_length(cfg: RunConfig, rows: list[dict[str, Any]]) -> None:
    """The trainer's logit temperature and optimizer steps per rollout, and an RL run's length from ``--num-epoch`` (checked against the critic-only
    rule); before ``args`` is built, so user functions see them."""
    cfg.train.logit_temperature = cfg.trainer_logit_temperature
    cfg.train.num_steps_per_rollout = cfg.steps_per_rollout
    if cfg.num_epoch is not None and not cfg.is_sft:  # slime: one epoch = every prompt once
        cfg.num_rollout = math.ceil(cfg.num_epoch * len(rows) / cfg.rollout_batch_size)
        ok, problem = cfg.critic_only_rule(cfg.num_rollout, f", from --num-epoch {cfg.num_epoch}")
        if not ok:
            raise ValueError(problem)
    elif cfg.num_rollout is None and not cfg.is_sft:  # SFT's comes from its demonstrations (_resolve)
        cfg.num_rollout = DEFAULT_NUM_ROLLOUT


def _resolve(cfg: RunConfig, *, demos: list[Sample] | None, checkpoint: Path, critic: Path | None) -> RunConfig:
    """The last derived values (checkpoint folders, an SFT run's length from its demonstrations); the configuration
    returned read-only."""
    cfg.hf_checkpoint = str(checkpoint)
    if critic is not None:
        cfg.critic_hf_checkpoint = str(critic)
    if demos is not None:
        cfg.num_rollout = sft_steps(cfg, len(demos))
    return read_only(cfg)
