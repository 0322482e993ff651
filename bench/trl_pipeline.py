"""The README's main job done with TRL: warm start (SFTTrainer) then GRPO with a tool (GRPOTrainer).

    python bench/trl_pipeline.py [--model default|tiny] [--out runs/trl_pipeline] [--threads N]
                                 [--sft-steps N] [--rl-steps N] [--limit N]
    python bench/trl_pipeline.py --model tiny --sft-steps 1 --rl-steps 1 --limit 2   # smoke run, ~1 min

What is compared: ``bench/main_job.py`` measures agentrl's own pipeline (``agentrl sft --config
examples/calculator_agent/sft.yaml`` then ``agentrl train --config examples/calculator_agent/grpo.yaml``);
this script runs the same pipeline with TRL, on the same model, tasks, steps and threads, and scores
every checkpoint with the exact same ``agentrl eval`` command (``bench.main_job.EVAL``: 200 held-out
problems, greedy, up to 3 turns of 64 tokens; ``--limit`` only for smoke runs):

1. TRL ``SFTTrainer`` on the warm start's demonstrations: the scripted ``solver_policy`` played on
   ``Calculator.tasks()`` (64 tasks) by agentrl's own ``play``, as OpenAI ``messages`` + ``tools``
   rows (system, user, assistant tool call, tool result, "The answer is N."). The assistant turns
   carry the solver's text verbatim, so TRL trains exactly the tokens agentrl's warm start trains
   (checked: same ids, same trained tokens; TRL adds the template's trailing ``\\n``). sft.yaml's
   optimizer steps (``num_rollout``), batch (``global_batch_size``, as micro-batch 4 x accumulation)
   and lr; AdamW betas 0.9/0.98, no weight decay, clip 1.0, constant lr, fp32, assistant-only loss.
2. TRL ``GRPOTrainer`` from the TRL warm start, ``tools=[calculator]`` (a Python function around
   ``agentrl.tools.calculator.evaluate``, errors returned as agentrl's ``"Error: ..."`` text), reward = exact
   answer (``Calculator.exact`` on the final assistant message; 0 when the episode ends on a tool
   call), on the same 64 tasks: grpo.yaml's steps (``num_rollout``), prompts per step
   (``rollout_batch_size``), generations per prompt (``n_samples_per_prompt``, also TRL's
   micro-batch), lr, ``rollout_temperature`` and ``shuffle_prompts`` (TRL's ``shuffle_dataset``),
   group-std advantages, per-sequence mean loss (``loss_type="grpo"``, as agentrl), eps 0.2, no KL,
   one optimizer step per rollout.
3. ``agentrl eval`` of the base model, the TRL warm start and TRL warm start + GRPO.

Wall time of each phase, per-optimizer-step times, accuracy and tool-call rate go to
``<out>/trl_pipeline.json``; a table is printed. ``--threads`` sets torch's threads here and
``OMP_NUM_THREADS`` for the eval engines.

What TRL cannot do out of the box here, and the workarounds (nothing in TRL or transformers is patched):

* SmolLM2's own chat template is plain ChatML that ignores ``tools`` and has no ``{% generation %}``
  markers: ``SFTTrainer(assistant_only_loss=True)`` raises ``ValueError: The chat template is not
  training-compatible ... patching is not supported for this template`` (``get_training_chat_template``,
  called from ``SFTTrainer.__init__``), and ``GRPOTrainer(tools=...)`` raises ``ValueError: The provided
  chat template does not support tool calling`` (grpo_trainer.py, the ``supports_tool_calling``
  check in ``__init__``). Both are recorded under ``tool_support_probe``. Workaround: the tokenizer gets
  agentrl's built-in Hermes-style tool template (what agentrl renders for this model when tools are
  offered), with ``{% generation %}`` markers for SFT (``bench.p9_sft._marked_template``).
* ``add_response_schema`` (called by ``GRPOTrainer.__init__`` when the tokenizer has no
  ``response_template``) only knows a fixed list of templates and raises ``ValueError: Unrecognized
  chat template, failed to add response schema`` for this one (chat_template_utils.py). Workaround:
  set ``tokenizer.response_template = trl.chat_template_utils.qwen3_template`` ourselves: the
  ``<tool_call>{json}</tool_call>`` wire format the built-in template writes and agentrl's ``hermes``
  parser reads (transformers >= 5.13 parses it).
* A tool is a Python function whose JSON schema transformers derives from its signature and
  docstring; a return annotation would add a ``"return"`` key and change the system prompt. The
  function has none, and its docstring is built from agentrl's tool description, so the prompt TRL
  renders is byte-identical to agentrl's rollout prompt (checked).
* TRL has one completion budget for the whole multi-turn episode (assistant + tool tokens), not
  agentrl's per-turn limit: ``max_completion_length = max_turns x rollout_max_turn_len`` (192)
  with ``max_tool_calling_iterations = max_turns - 1`` (so at most 3 assistant turns). TRL's SFT
  loss is a mean over the batch's tokens; agentrl's warm start averages each sample's mean.
* Checkpoints: ``save_pretrained`` of the model only, plus the base model's ORIGINAL tokenizer files
  copied in, so ``agentrl eval`` renders prompts exactly as for agentrl's own checkpoints (a saved
  TRL tokenizer would carry the modified template and the response template).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from bench import main_job  # noqa: E402

SFT_YAML = REPO / "examples" / "calculator_agent" / "sft.yaml"
GRPO_YAML = REPO / "examples" / "calculator_agent" / "grpo.yaml"
MICRO_BATCH = 4  # per-device batch of both trainers; the rest of the global batch is gradient accumulation
SEED = 1234  # agentrl's TrainConfig.seed
TOKENIZER_FILE_PARTS = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template")


class StepTimer(TrainerCallback):
    """Seconds of each optimizer step (for GRPO: generation, tool calls and scoring included)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._t0 = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seconds.append(round(time.perf_counter() - self._t0, 2))
        print(f"  step {len(self.seconds)}: {self.seconds[-1]:.1f}s", flush=True)


def calculator(expression: str):  # no return annotation: it would add "return" to the tool's JSON schema
    from agentrl.tool import ToolError
    from agentrl.tools.calculator import evaluate, format_number

    try:
        return format_number(evaluate(expression))
    except ToolError as e:  # what agentrl's ToolEnv shows the model
        return f"Error: {e}"


def _tool_docstring() -> str:
    from agentrl.tools.calculator import calculator as tool

    arg = tool.parameters["properties"]["expression"]["description"]
    return f"{tool.description}\n\nArgs:\n    expression: {arg}\n"


calculator.__doc__ = _tool_docstring()


def exact_answer(completions: list[list[dict]], label: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the episode's final assistant message (no tool call) ends on the label's number (``Calculator.exact``)."""
    from agentrl.envs.calculator import Calculator
    from agentrl.types import Action

    out = []
    for messages, lab in zip(completions, label):
        last = messages[-1] if messages else {}
        final = last.get("role") == "assistant" and not last.get("tool_calls")
        text = (last.get("content") or "") if final else ""
        out.append(1.0 if final and Calculator.exact(SimpleNamespace(task={"label": lab}), Action(text=text)) else 0.0)
    return out


def base_checkpoint(model: str, out: Path) -> Path:
    if model == "tiny":
        from agentrl.tiny import build_model

        return build_model(out / "tiny_base", hidden_size=256, num_layers=4)
    from agentrl.checkpoint import resolve_hf_checkpoint

    return Path(resolve_hf_checkpoint(None))


def save_checkpoint(model: Any, base: Path, path: Path) -> None:
    """The trained weights plus the base model's original tokenizer files (not the trainer's tokenizer)."""
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(path, safe_serialization=True)
    for f in base.iterdir():
        if f.is_file() and any(p in f.name for p in TOKENIZER_FILE_PARTS):
            shutil.copy2(f, path / f.name)


def demonstrations(base: Path, max_turns: int) -> tuple[list[Any], list[Any]]:
    """The warm start's episodes (agentrl's ``play`` of ``solver_policy``) and agentrl's token-exact Samples of them."""
    from transformers import AutoTokenizer

    from agentrl.chat import ChatTemplate
    from agentrl.envs.calculator import Calculator, solver_policy
    from agentrl.rollout.demos import played_sample
    from agentrl.rollout.scripted import play_sync

    results = play_sync(Calculator, solver_policy, Calculator.tasks(), max_turns=max_turns)
    bad = [r.error for r in results if r.error or r.reward < 1.0]
    if bad:
        raise SystemExit(f"the solver failed on {len(bad)} tasks: {bad[:3]}")
    template = ChatTemplate(AutoTokenizer.from_pretrained(str(base)))
    return results, [played_sample(template, r, f"task {i}") for i, r in enumerate(results)]


def sft_rows(results: list[Any]) -> list[dict]:
    """OpenAI ``messages`` + ``tools`` rows; assistant turns are the solver's text verbatim (tool-call markup included)."""
    rows = []
    for r in results:
        messages, turn = [], 0
        for m in r.messages:
            if m["role"] == "assistant":
                messages.append({"role": "assistant", "content": r.texts[turn]})
                turn += 1
            else:
                messages.append({k: m[k] for k in ("role", "content", "name", "tool_call_id") if k in m})
        rows.append({"messages": messages, "tools": json.dumps(r.tools)})
    return rows


def train_sft(base: Path, results: list[Any], agentrl_samples: list[Any], cfg: dict, steps: int, out: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from agentrl.trainer.torch_trainer import load_causal_lm
    from bench.p9_sft import _marked_template

    t0 = time.monotonic()
    batch = int(cfg["global_batch_size"])
    tok = AutoTokenizer.from_pretrained(str(base))
    tok.chat_template = _marked_template()
    args = SFTConfig(
        output_dir=str(out / "trl_sft_work"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to=[],
        seed=SEED,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=batch // MICRO_BATCH,
        max_steps=steps,
        learning_rate=float(cfg["lr"]),
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.98,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        assistant_only_loss=True,
        max_length=None,
        save_strategy="no",
        logging_steps=1,
        dataloader_drop_last=False,
    )
    model = load_causal_lm(base, torch.float32, torch.device("cpu"))
    timer = StepTimer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(sft_rows(results)),
            processing_class=tok,
            callbacks=[timer],
        )
    ds = trainer.train_dataset
    same = sum(
        ids[: len(s.tokens)] == list(s.tokens) and sum(1 for x in lab if x != -100) == sum(s.loss_mask)
        for ids, lab, s in zip(ds["input_ids"], ds["labels"], agentrl_samples)
    )
    check = {
        "rows": len(ds),
        "rows_same_tokens_as_agentrl": same,
        "trained_tokens": sum(sum(1 for x in lab if x != -100) for lab in ds["labels"]),
        "agentrl_trained_tokens": sum(sum(s.loss_mask) for s in agentrl_samples),
    }
    if same != len(ds):
        print(f"WARNING: TRL's SFT rows differ from agentrl's demonstrations: {check}", file=sys.stderr)
    t1 = time.monotonic()
    trainer.train()
    train_s = time.monotonic() - t1
    save_checkpoint(trainer.model, base, out / "trl_sft")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "seconds": round(time.monotonic() - t0, 1),
        "train_seconds": round(train_s, 1),
        "steps": steps,
        "step_seconds": timer.seconds,
        "loss": losses,
        "token_check": check,
    }


def _add_response_schema(tok: Any) -> str:
    from trl.chat_template_utils import add_response_schema

    try:
        add_response_schema(tok)
        return "ok"
    except ValueError as e:
        return f"ValueError: {str(e).split('. ')[0]}"


def tool_support_probe(base: Path) -> dict:
    """What TRL's own checks say about the model's template and agentrl's built-in tool template."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import get_training_chat_template, supports_tool_calling

    from agentrl.chat import BUILTIN_TOOL_TEMPLATE

    tok = AutoTokenizer.from_pretrained(str(base))
    probe: dict[str, Any] = {
        "native_template_supports_tool_calling": supports_tool_calling(tok),
        "add_response_schema_native": _add_response_schema(tok),
    }
    try:  # what SFTTrainer(assistant_only_loss=True) does with a template without {% generation %} markers
        get_training_chat_template(tok)
        probe["sft_training_template_native"] = "ok"
    except ValueError as e:
        probe["sft_training_template_native"] = f"ValueError: {str(e).split('. ')[0]}"
    tok.chat_template = BUILTIN_TOOL_TEMPLATE
    probe["builtin_template_supports_tool_calling"] = supports_tool_calling(tok)
    probe["add_response_schema_builtin"] = _add_response_schema(tok)
    return probe


def train_grpo(start: Path, base: Path, results: list[Any], cfg: dict, steps: int, out: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.utils import get_json_schema
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from agentrl.chat import BUILTIN_TOOL_TEMPLATE, ChatTemplate
    from agentrl.trainer.torch_trainer import load_causal_lm

    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(str(start))
    tok.chat_template = BUILTIN_TOOL_TEMPLATE  # workaround 1: a template that renders tools
    tok.response_template = qwen3_template  # workaround 2: the Hermes <tool_call> JSON parser
    schema_same = [get_json_schema(calculator)] == results[0].tools
    prompts = [r.messages[:2] for r in results]  # system + user, as the env's reset gives them
    trl_prompt = tok.apply_chat_template(prompts[0], tools=[calculator], add_generation_prompt=True, tokenize=False)
    agentrl_prompt = ChatTemplate(AutoTokenizer.from_pretrained(str(base))).render(
        prompts[0], results[0].tools, add_generation_prompt=True
    )
    if trl_prompt != agentrl_prompt:
        print("WARNING: TRL renders a different prompt than agentrl's rollout", file=sys.stderr)
    group = int(cfg["n_samples_per_prompt"])  # micro-batch = one group: TRL needs batches divisible by it
    per_step = int(cfg["rollout_batch_size"]) * group
    temperature = float(cfg.get("rollout_temperature", 1.0))
    max_turns, turn_len = int(cfg["max_turns"]), int(cfg["rollout_max_turn_len"])
    args = GRPOConfig(
        output_dir=str(out / "trl_grpo_work"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to=[],
        seed=SEED,
        per_device_train_batch_size=group,
        gradient_accumulation_steps=per_step // group,
        max_steps=steps,
        num_generations=int(cfg["n_samples_per_prompt"]),
        num_iterations=1,
        learning_rate=float(cfg["lr"]),
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.98,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        beta=0.0,
        epsilon=0.2,
        loss_type="grpo",
        scale_rewards="group",
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        shuffle_dataset=bool(cfg.get("shuffle_prompts", True)),
        max_completion_length=max_turns * turn_len,
        max_tool_calling_iterations=max_turns - 1,
        save_strategy="no",
        logging_steps=1,
        log_completions=False,
    )
    model = load_causal_lm(start, torch.float32, torch.device("cpu"))
    data = Dataset.from_list([{"prompt": p, "label": r.task["label"]} for p, r in zip(prompts, results)])
    timer = StepTimer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=exact_answer,
            args=args,
            train_dataset=data,
            processing_class=tok,
            tools=[calculator],
            callbacks=[timer],
        )
    t1 = time.monotonic()
    trainer.train()
    train_s = time.monotonic() - t1
    save_checkpoint(trainer.model, base, out / "trl_grpo")
    keys = ("reward", "tools/call_frequency", "tools/failure_frequency", "completions/mean_length", "loss")
    log = [{k: round(h[k], 4) for k in keys if k in h} for h in trainer.state.log_history if "reward" in h]
    return {
        "seconds": round(time.monotonic() - t0, 1),
        "train_seconds": round(train_s, 1),
        "steps": steps,
        "step_seconds": timer.seconds,
        "tool_schema_same_as_agentrl": schema_same,
        "prompt_same_as_agentrl": trl_prompt == agentrl_prompt,
        "samples_per_step": per_step,
        "max_completion_length": max_turns * turn_len,
        "log": log,
    }


def evaluate(checkpoint: Path, out: Path, name: str, limit: int | None, threads: int | None) -> dict:
    """``bench.main_job.evaluate`` (the README's eval), optionally on the first ``limit`` problems, timed."""
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {})}
    t0 = time.monotonic()
    r = main_job.evaluate(str(checkpoint), out, name, *(["--num-tasks", str(limit)] if limit else []), env=env)
    return {**r, "seconds": round(time.monotonic() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "default"], default="default")
    p.add_argument("--out", default="runs/trl_pipeline")
    p.add_argument("--threads", type=int, default=None, help="torch threads (and OMP_NUM_THREADS for the evals)")
    p.add_argument("--sft-steps", type=int, default=None, help="default: sft.yaml's num_rollout")
    p.add_argument("--rl-steps", type=int, default=None, help="default: grpo.yaml's num_rollout")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N held-out problems (smoke runs)")
    p.add_argument("--skip-base-eval", action="store_true", help="the base model's eval is main_job.py's, skip it")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out) if Path(a.out).is_absolute() else REPO / a.out
    out.mkdir(parents=True, exist_ok=True)
    sft_cfg, grpo_cfg = yaml.safe_load(SFT_YAML.read_text()), yaml.safe_load(GRPO_YAML.read_text())
    sft_steps = a.sft_steps or int(sft_cfg["num_rollout"])
    rl_steps = a.rl_steps or int(grpo_cfg["num_rollout"])
    base = base_checkpoint(a.model, out)
    print(
        f"model {base}, torch threads {torch.get_num_threads()}, SFT {sft_steps} steps, GRPO {rl_steps} steps",
        flush=True,
    )
    summary: dict[str, Any] = {
        "model": str(base),
        "threads": torch.get_num_threads(),
        "limit": a.limit,
        "tool_support_probe": tool_support_probe(base),
    }
    t = time.monotonic()
    results, samples = demonstrations(base, int(sft_cfg["max_turns"]))
    summary["demo_seconds"] = round(time.monotonic() - t, 1)
    print("phase: TRL SFT", flush=True)
    summary["sft"] = train_sft(base, results, samples, sft_cfg, sft_steps, out)
    print("phase: TRL GRPO with tools", flush=True)
    try:
        summary["grpo"] = train_grpo(out / "trl_sft", base, results, grpo_cfg, rl_steps, out)
    except Exception as e:  # recorded with where it was raised; the evals still run on what exists
        frame = traceback.extract_tb(e.__traceback__)[-1]
        summary["grpo"] = {"error": f"{type(e).__name__}: {e}", "raised_at": f"{frame.filename}:{frame.lineno}"}
        print(f"GRPO failed: {summary['grpo']}", file=sys.stderr)
    evals = {"base": base, "TRL SFT": out / "trl_sft", "TRL SFT+GRPO": out / "trl_grpo"}
    if a.skip_base_eval:
        del evals["base"]
    summary["results"] = {}
    for name, ckpt in evals.items():
        if name == "TRL SFT+GRPO" and "error" in summary["grpo"]:
            continue
        print(f"phase: eval {name}", flush=True)
        slug = name.lower().replace(" ", "_").replace("+", "_")
        summary["results"][name] = evaluate(ckpt, out, slug, a.limit, a.threads)
    (out / "trl_pipeline.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\n{'checkpoint':<14} {'accuracy':>8} {'tool calls':>10} {'turns':>6} {'train s':>8} {'eval s':>7}")
    train_s = {"TRL SFT": summary["sft"]["train_seconds"], "TRL SFT+GRPO": summary["grpo"].get("train_seconds", "")}
    for name, r in summary["results"].items():
        print(
            f"{name:<14} {r['accuracy']:>8.3f} {r['tool_call_rate']:>10.3f} {r['turns_mean']:>6.2f} "
            f"{train_s.get(name, ''):>8} {r['seconds']:>7}"
        )
    print(
        f"SFT step seconds {summary['sft']['step_seconds']}; GRPO step seconds "
        f"{summary['grpo'].get('step_seconds', summary['grpo'].get('error'))}; wrote {out / 'trl_pipeline.json'}"
    )


if __name__ == "__main__":
    main()
