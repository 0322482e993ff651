"""P4: train tokens/s of agentrl's ``torch`` trainer / TRL's ``GRPOTrainer``, same samples, same run. Goal >= 1.5.

    python bench/p4_train_throughput.py [--model tiny|default] [--samples 16] [--micro-batch 4] [--reps 5]
                                        [--max-tokens-per-gpu 1280,4096] [--threads N]

Both sides train the SAME fixed samples (prompt 40-120 + response 20-200 tokens, random ids, response
loss masks with 0-spans standing in for tool outputs, advantage +-1 per sample) from the SAME
initial weights, one optimizer step per repetition: fused AdamW (same lr, betas, no weight decay), grad
clip 1.0, fp32, no gradient checkpointing, no KL/reference model, sample-mean loss (agentrl's
default; TRL ``loss_type="grpo"``), old log-probs = detached current ones on both sides (one
pass per rollout). Same process, same ``torch`` threads; repetitions interleave A,B,A,B.

  agentrl: ``TorchTrainer.train_step(samples)`` with ``global_batch_size = --samples``: the samples
    are packed (first-fit decreasing) into micro-batches of at most ``max_tokens_per_gpu`` tokens,
    no padding. Two budgets by default, each its own column: ``--micro-batch x L`` = 1280 tokens
    (L = 320 = the longest possible sample: the worst case of TRL's padded micro-batch, so the
    same activation-memory bound on both sides) and TrainConfig's default 4096. Attention inside a
    packed row runs per sample (``agentrl.trainer.packed_attention``); before that, CPU SDPA with
    the block-diagonal mask computed all T x T scores of the row and a 1280-token row cost the tiny
    model everything packing saved (ratio 1.01 there, 1.61 with 320-token rows).
  TRL: GRPOTrainer's own training path with generation swapped out. A subclass overrides ONLY
    ``_generate_and_score_completions`` to return the samples as that method would
    (``prompt_ids`` left-padded, ``completion_ids`` right-padded over the whole generation batch,
    ``completion_mask``, ``tool_mask`` = our loss mask, ``advantages`` [B], ``num_items_in_batch``);
    TRL's ``_prepare_inputs`` then shuffles and splits it into ``--samples / --micro-batch``
    micro-batches and ``training_step`` runs its ``compute_loss`` (fused LM head over completion
    positions) + backward on each; then, as ``Trainer._run_epoch`` does, ``_clip_grad_norm``,
    ``optimizer.step``, ``lr_scheduler.step``, ``zero_grad``. Not timed: TRL's dataloader, callbacks,
    logging (and generation/reward scoring, which agentrl does outside ``train_step`` too).

Tokens/s on both sides = (prompt + response tokens of the samples, no padding) / seconds of one
optimizer step. Model loading and each side's first (warm-up) step are excluded.

Offline-on-CPU workarounds for TRL (nothing else is patched): ``GRPOConfig(use_cpu=True, bf16=False,
gradient_checkpointing=False, report_to=[])``, a zero reward function (never called), an in-memory
``datasets.Dataset`` of placeholder prompts (never read), the model passed as an instance.

``--model tiny`` builds a random-init Llama (hidden 256, 4 layers, vocab 400) in a temp dir;
``--model default`` is SmolLM2-135M-Instruct (``resolve_hf_checkpoint``; 20-70 s per step and
side here: use ``--reps 2``). On a shared 2-core machine, ``--threads 1`` keeps both sides from
oversubscribing the cores when another job runs (2 OpenMP threads on 1 free core run ~10x slower).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from agentrl.config import TrainConfig  # noqa: E402
from agentrl.trainer.base import TrainSample  # noqa: E402

PROMPT_LEN = (40, 120)
RESPONSE_LEN = (20, 200)
LR = 1e-6


def make_samples(n: int, vocab: int, seed: int = 0) -> list[TrainSample]:
    """``n`` samples of varied lengths; each response alternates policy turns (mask 1) and tool outputs (mask 0)."""
    rng, ids = random.Random(seed), random.Random(seed + 1)  # lengths and masks do not depend on the vocab
    out = []
    for i in range(n):
        p, r = rng.randint(*PROMPT_LEN), rng.randint(*RESPONSE_LEN)
        tokens = [ids.randrange(3, vocab) for _ in range(p + r)]
        mask: list[int] = []
        on = 1
        while len(mask) < r:
            span = rng.randint(8, 40) if on else rng.randint(5, 25)
            mask.extend([on] * min(span, r - len(mask)))
            on ^= 1
        adv = 1.0 if i % 2 == 0 else -1.0
        out.append(TrainSample(tokens=tokens, response_length=r, loss_mask=mask, advantages=[adv] * r))
    return out


class AgentrlSide:
    def __init__(self, ckpt: Path, samples: list[TrainSample], max_tokens: int, variant: str = "", lora_rank: int = 0):
        self.name = f"agentrl@{max_tokens}" + (f"/{variant}" if variant else "")
        from agentrl.trainer.torch_trainer import TorchTrainer

        cfg = TrainConfig(
            lr=LR,
            global_batch_size=len(samples),
            num_steps_per_rollout=1,
            max_tokens_per_gpu=max_tokens,
            dtype="float32",
            gradient_checkpointing=variant == "lora_gc",
            clip_grad=1.0,
            weight_decay=0.0,
            lora_rank=lora_rank if variant in ("lora", "lora_gc") else 0,
        )
        # in-run baselines: plain = the trainer before chunked log-probs, lean activations and resident
        # optimizer state; nochunk / nolean / unfused = without one of them (unfused: gradients freed every
        # step, moments created at the first step, torch's per-tensor AdamW)
        if variant not in ("", "plain", "nochunk", "nolean", "unfused", "lora", "lora_gc"):
            raise SystemExit(f"unknown agentrl variant {variant!r}: plain, nochunk, nolean, unfused, lora or lora_gc")
        if variant in ("lora", "lora_gc") and not lora_rank:
            raise SystemExit(f"the {variant} variant needs --lora-rank")
        self.trainer = TorchTrainer(ckpt, cfg, device="cpu", resident_state=variant not in ("plain", "unfused"))
        if variant in ("plain", "nochunk"):
            self.trainer.chunked_logprobs = False
        if variant in ("plain", "nolean"):
            for m in self.trainer.model.modules():
                m.__dict__.pop("forward", None)  # each module's own forward again
        self.samples = samples

    def step(self) -> float:
        t0 = time.perf_counter()
        self.trainer.train_step(self.samples)
        return time.perf_counter() - t0


def _trl_batch(samples: list[TrainSample], pad_id: int) -> dict:
    """The dict ``GRPOTrainer._generate_and_score_completions`` returns, for these samples."""
    from trl.trainer.utils import pad

    prompts = [torch.tensor(s.tokens[: s.prompt_length]) for s in samples]
    completions = [torch.tensor(s.tokens[s.prompt_length :]) for s in samples]
    tool_mask = pad([torch.tensor(s.loss_mask) for s in samples], padding_value=1, padding_side="right")
    completion_mask = pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right")
    return {
        "prompt_ids": pad(prompts, padding_value=pad_id, padding_side="left"),
        "prompt_mask": pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"),
        "completion_ids": pad(completions, padding_value=pad_id, padding_side="right"),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([s.advantages[0] for s in samples]),
        "num_items_in_batch": (completion_mask * tool_mask).sum(),
        "tool_mask": tool_mask,
    }


class TrlSide:
    def __init__(self, ckpt: Path, samples: list[TrainSample], micro_batch: int, out_dir: str, lora_rank: int = 0):
        self.name = "TRL/lora" if lora_rank else "TRL"
        from datasets import Dataset
        from transformers import AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        from agentrl.trainer.torch_trainer import load_causal_lm

        class ReplayGRPOTrainer(GRPOTrainer):
            """GRPOTrainer whose generation + scoring hands back pre-built samples."""

            batch: dict = {}

            def _generate_and_score_completions(self, inputs):
                return dict(self.batch)

        if len(samples) % micro_batch:
            raise SystemExit("--samples must be a multiple of --micro-batch")
        self.accum = len(samples) // micro_batch
        tok = AutoTokenizer.from_pretrained(str(ckpt))
        args = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            report_to=[],
            per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=self.accum,
            num_generations=2,
            loss_type="grpo",
            beta=0.0,
            learning_rate=LR,
            adam_beta1=0.9,
            adam_beta2=0.98,
            weight_decay=0.0,
            max_grad_norm=1.0,
            optim="adamw_torch_fused",  # what agentrl's trainer runs on CPU (and transformers' default)
            lr_scheduler_type="constant",
            disable_dropout=True,
            max_completion_length=RESPONSE_LEN[1],
            save_strategy="no",
            logging_steps=10**9,
            seed=0,
        )

        def zero_reward(completions, **kwargs):
            return [0.0] * len(completions)

        model = load_causal_lm(ckpt, torch.float32, torch.device("cpu"))
        peft_config = None
        if lora_rank:  # the same PEFT config agentrl's --lora-rank builds
            from agentrl.trainer.lora import lora_config

            peft_config = lora_config(TrainConfig(lora_rank=lora_rank))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            placeholder = Dataset.from_dict({"prompt": ["placeholder"] * len(samples)})
            self.trainer = ReplayGRPOTrainer(
                model=model,
                reward_funcs=zero_reward,
                args=args,
                processing_class=tok,
                train_dataset=placeholder,
                peft_config=peft_config,
            )
        self.trainer.batch = _trl_batch(samples, tok.pad_token_id if tok.pad_token_id is not None else 0)
        self.trainer.create_optimizer_and_scheduler(num_training_steps=10**6)

    def step(self) -> float:
        """One optimizer step as ``Trainer._run_epoch`` makes it (minus dataloader, callbacks, logging)."""
        t, model = self.trainer, self.trainer.model
        t.current_gradient_accumulation_steps = self.accum
        t0 = time.perf_counter()
        for i in range(self.accum):
            t.accelerator.gradient_state._set_sync_gradients(i == self.accum - 1)
            t.training_step(model, [], None)  # first call of a step "generates" (returns the batch), then splits it
        t._clip_grad_norm(model)
        t.optimizer.step()
        t.lr_scheduler.step()
        model.zero_grad()
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "default"], default="tiny")
    p.add_argument("--hf-checkpoint", default=None, help="any local HF checkpoint (overrides --model)")
    p.add_argument("--samples", type=int, default=16, help="samples per optimizer step (both sides)")
    p.add_argument("--micro-batch", type=int, default=4, help="TRL per_device_train_batch_size")
    p.add_argument(
        "--max-tokens-per-gpu",
        default=None,
        help="agentrl packing budget(s), comma-separated (default: micro-batch x L, L = longest "
        "possible sample = 320, and 4096, TrainConfig's default before it became 512 on CPU)",
    )
    p.add_argument("--reps", type=int, default=5, help="speed repetitions (0 with --peak-rss: memory only)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    p.add_argument(
        "--variants",
        default="",
        help="also run these agentrl variants at each budget, comma-separated: plain (as before chunked "
        "log-probs, lean activations and resident optimizer state: full [N, V] logits, the modules' own "
        "forwards, gradients freed every step, per-tensor AdamW), nochunk, nolean, unfused (gradients "
        "freed every step, moments created at the first step, per-tensor AdamW), lora_gc (the lora variant with "
        "--gradient-checkpointing: each decoder layer recomputed in backward; needs --lora-rank)",
    )
    p.add_argument(
        "--peak-rss",
        action="store_true",
        help="after the speed table, run each side alone in a fresh process for 2 steps and report its peak RSS",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="also train LoRA adapters of this rank (all-linear, alpha = rank, the same PEFT config on both sides): "
        "the agentrl 'lora' variant (added to --variants) against a 'TRL/lora' side; the full fine-tuning columns "
        "stay, against full TRL, as the in-run baseline of memory and speed",
    )
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)  # internal: one side, 2 steps, print peak RSS
    a = p.parse_args()
    if a.reps < 0 or (a.reps == 0 and not a.peak_rss and not a.side):
        p.error("--reps must be >= 1 (0 only with --peak-rss: memory only)")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.lora_rank and "lora" not in a.variants.split(","):
        a.variants = ",".join(v for v in (a.variants, "lora") if v)

    tmp = tempfile.mkdtemp(prefix="p4_")
    if a.hf_checkpoint:
        ckpt = Path(a.hf_checkpoint)
    elif a.model == "tiny":
        from agentrl.tiny import build_model

        ckpt = build_model(Path(tmp) / "tiny", hidden_size=256, num_layers=4)
    else:
        from agentrl.checkpoint import resolve_hf_checkpoint

        ckpt = Path(resolve_hf_checkpoint(None))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(ckpt)).vocab_size
    samples = make_samples(a.samples, vocab)
    longest = PROMPT_LEN[1] + RESPONSE_LEN[1]
    budgets = (
        [int(b) for b in a.max_tokens_per_gpu.split(",")] if a.max_tokens_per_gpu else [a.micro_batch * longest, 4096]
    )
    tokens = sum(len(s.tokens) for s in samples)
    padded = a.samples * (max(s.prompt_length for s in samples) + max(s.response_length for s in samples))
    print(
        f"model {ckpt} (vocab {vocab}), torch threads {torch.get_num_threads()}; {a.samples} samples/step, "
        f"{tokens} tokens, {padded} as TRL pads them (x{padded / tokens:.2f}: the ceiling of packing's gain "
        f"at equal per-token cost); TRL micro-batch {a.micro_batch}, agentrl budgets {budgets} tokens"
    )

    def build(name: str):
        if name.startswith("TRL"):
            return TrlSide(ckpt, samples, a.micro_batch, tmp, a.lora_rank if name == "TRL/lora" else 0)
        budget, _, variant = name.removeprefix("agentrl@").partition("/")
        return AgentrlSide(ckpt, samples, int(budget), variant, a.lora_rank)

    names = [f"agentrl@{b}{v}" for b in budgets for v in [""] + [f"/{v}" for v in a.variants.split(",") if v]]
    baselines = ["TRL"] + (["TRL/lora"] if a.lora_rank else [])  # LoRA columns against TRL with the same adapter

    def baseline(name: str) -> str:
        return "TRL/lora" if name.endswith("/lora") else "TRL"

    names += baselines
    if a.side:  # a child of --peak-rss: this side alone, warm-up + one step, then its high-water mark
        from agentrl.runtime.cluster import peak_rss_mb

        before = peak_rss_mb()  # imports and the samples: what every side pays before its model exists
        side = build(a.side)
        side.step()
        side.step()
        print(f"BASE_RSS_MB {before} PEAK_RSS_MB {peak_rss_mb()}")
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if a.reps == 0 and a.peak_rss:  # memory only
        _peak_rss(names, ckpt, a)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    sides = [build(n) for n in names]
    for side in sides:  # warm-up (allocator, AdamW state), not counted
        print(f"warm-up {side.name}: {side.step():.2f}s", flush=True)
    rates: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names if n not in baselines}
    print(
        "rep "
        + " ".join(f"{n + ' tok/s':>22}" for n in names)
        + " "
        + " ".join(f"{'ratio' + n.removeprefix('agentrl'):>17}" for n in ratios)
    )
    for r in range(a.reps):
        order = sides if r % 2 == 0 else sides[::-1]  # A,B then B,A: neither side always runs first
        for side in order:
            rates[side.name].append(tokens / side.step())
        for n in ratios:
            ratios[n].append(rates[n][-1] / rates[baseline(n)][-1])
        print(
            f"{r:>3} "
            + " ".join(f"{rates[n][-1]:>22.1f}" for n in names)
            + " "
            + " ".join(f"{ratios[n][-1]:>17.2f}" for n in ratios),
            flush=True,
        )
    for n in ratios:
        print(
            f"P4 train tokens/s ({n} / {baseline(n)} GRPOTrainer, micro-batch "
            f"{a.micro_batch}), median of {a.reps}: {statistics.median(ratios[n]):.2f}  (goal >= 1.5)"
        )
    if a.peak_rss:
        del sides  # the children measure alone
        _peak_rss(names, ckpt, a)
    shutil.rmtree(tmp, ignore_errors=True)


def _peak_rss(names: list[str], ckpt: Path, a: argparse.Namespace) -> None:
    """Each side in a fresh process (load, warm-up, one step): its peak RSS, not the shared process's."""
    import subprocess

    base = [sys.executable, __file__, "--hf-checkpoint", str(ckpt), "--samples", str(a.samples)]
    base += ["--micro-batch", str(a.micro_batch)] + (["--threads", str(a.threads)] if a.threads else [])
    base += ["--lora-rank", str(a.lora_rank)]
    peaks = {}
    for name in names:
        out = subprocess.run(base + ["--side", name], capture_output=True, text=True, check=True).stdout
        peaks[name] = float(out.rsplit("PEAK_RSS_MB", 1)[1])
        base_mb = float(out.rsplit("BASE_RSS_MB", 1)[1].split()[0])
        print(f"peak RSS {name}: {peaks[name]:.0f} MiB (before loading the model: {base_mb:.0f} MiB)", flush=True)
    print(
        "P4 peak RSS (one process per side, load + 2 steps): "
        + ", ".join(f"{n} {v / 1024:.2f} GiB" for n, v in peaks.items())
    )


if __name__ == "__main__":
    main()
