"""P9: SFT train tokens/s of agentrl's warm start / TRL's ``SFTTrainer``, same conversations, same run. Goal >= 1.5.

    python bench/p9_sft.py [--model tiny|default] [--conversations 16] [--micro-batch 4] [--reps 5]
                           [--max-tokens-per-gpu 4096] [--threads N]

Both sides train the SAME multi-turn tool-use conversations (GSM8K's calculator annotations as
OpenAI-format ``{"messages", "tools"}`` rows, :func:`agentrl.envs.gsm8k.write_conversations`) from the SAME
initial weights, one optimizer step per repetition over all ``--conversations``: fused AdamW (same lr,
betas, no weight decay), grad clip 1.0, fp32, no gradient checkpointing, loss on the assistant
tokens only (their end-of-turn token included). Same process, same ``torch`` threads; repetitions
interleave A,B,A,B.

  agentrl: the rows become token-exact Samples (:func:`agentrl.rollout.demos.conversation_samples`,
    the chat template the rollout uses) and ``TorchTrainer.train_step`` with ``--loss-type
    sft_loss`` packs them (first-fit decreasing) into micro-batches of at most
    ``--max-tokens-per-gpu`` tokens, no padding.
  TRL: ``SFTTrainer`` on the same rows (``messages`` + ``tools`` columns), ``assistant_only_loss=True``,
    its own tokenization through the same template text with ``{% generation %}`` markers around what
    the assistant writes (SmolLM2's own template ignores ``tools`` and has no markers: TRL would
    refuse assistant-only loss on it), its default collator (padding to the longest of each
    micro-batch of ``--micro-batch``), gradient accumulation over the rest. One optimizer step as
    ``Trainer`` makes it: ``training_step`` per micro-batch from its own dataloader, then
    ``_clip_grad_norm``, ``optimizer.step``, ``lr_scheduler.step``, ``zero_grad``.

The script checks that both sides train the same tokens (same sequence lengths, same number of
assistant tokens) and prints both. Tokens/s = real (unpadded) tokens / seconds of one optimizer
step; model loading and each side's first step are excluded. Peak memory: each side is then run
alone in a child process for two steps and its peak RSS (``VmHWM``) reported beside the speed.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

LR = 1e-5


def _marked_template() -> str:
    """agentrl's built-in tool template with TRL's ``{% generation %}`` markers around the assistant's own text."""
    from agentrl.chat import BUILTIN_TOOL_TEMPLATE

    head = "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    tail = "{{- '<|im_end|>\\n' }}\n{%- elif message['role'] == 'tool' %}"
    src = BUILTIN_TOOL_TEMPLATE
    assert src.count(head) == 1 and src.count(tail) == 1, "the built-in template changed: update the markers"
    src = src.replace(head, "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- (message['content'] or '') }}")
    return src.replace(
        tail, "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}\n{%- elif message['role'] == 'tool' %}"
    )


def conversations(n: int, out_dir: str) -> list[dict]:
    from agentrl.envs.gsm8k import write_conversations

    path = Path(out_dir) / "gsm8k_sft.jsonl"
    write_conversations("train", path, limit=int(n * 1.3) + 4)
    rows = [json.loads(x) for x in open(path)][:n]
    if len(rows) < n:
        raise SystemExit(f"only {len(rows)} conversations")
    return rows


class AgentrlSide:
    def __init__(self, ckpt: Path, rows: list[dict], max_tokens: int):
        from transformers import AutoTokenizer

        from agentrl.chat import ChatTemplate
        from agentrl.config import TrainConfig
        from agentrl.rollout.demos import conversation_samples
        from agentrl.trainer.base import TrainSample
        from agentrl.trainer.torch_trainer import TorchTrainer

        self.name = f"agentrl@{max_tokens}"
        template = ChatTemplate(AutoTokenizer.from_pretrained(str(ckpt)))
        demos, _ = conversation_samples([(f"row {i}", r) for i, r in enumerate(rows)], template)
        self.samples = [
            TrainSample(
                tokens=s.tokens,
                response_length=s.response_length,
                loss_mask=s.loss_mask,
                advantages=[0.0] * s.response_length,
            )
            for s in demos
        ]
        cfg = TrainConfig(
            loss_type="sft_loss",
            lr=LR,
            global_batch_size=len(rows),
            num_steps_per_rollout=1,
            max_tokens_per_gpu=max_tokens,
            dtype="float32",
            gradient_checkpointing=False,
            clip_grad=1.0,
            weight_decay=0.0,
            calculate_per_token_loss=True,
        )
        self.trainer = TorchTrainer(ckpt, cfg, device="cpu")
        self.lengths = sorted(len(s.tokens) for s in self.samples)
        self.trained = sum(sum(s.loss_mask) for s in self.samples)

    def step(self) -> float:
        t0 = time.perf_counter()
        self.trainer.train_step(self.samples)
        return time.perf_counter() - t0


class TrlSide:
    name = "TRL"

    def __init__(self, ckpt: Path, rows: list[dict], micro_batch: int, out_dir: str):
        from datasets import Dataset
        from transformers import AutoTokenizer
        from trl import SFTConfig, SFTTrainer

        from agentrl.trainer.torch_trainer import load_causal_lm

        if len(rows) % micro_batch:
            raise SystemExit("--conversations must be a multiple of --micro-batch")
        self.accum = len(rows) // micro_batch
        tok = AutoTokenizer.from_pretrained(str(ckpt))
        tok.chat_template = _marked_template()
        args = SFTConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            report_to=[],
            per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=self.accum,
            assistant_only_loss=True,
            max_length=None,
            learning_rate=LR,
            adam_beta1=0.9,
            adam_beta2=0.98,
            weight_decay=0.0,
            max_grad_norm=1.0,
            optim="adamw_torch_fused",  # what agentrl's trainer runs on CPU (and transformers' default)
            lr_scheduler_type="constant",
            save_strategy="no",
            logging_steps=10**9,
            seed=0,
            dataloader_drop_last=False,
        )
        model = load_causal_lm(ckpt, torch.float32, torch.device("cpu"))
        data = Dataset.from_list([{"messages": r["messages"], "tools": json.dumps(r["tools"])} for r in rows])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
        self.trainer.create_optimizer_and_scheduler(num_training_steps=10**6)
        ds = self.trainer.train_dataset
        self.lengths = sorted(len(x) for x in ds["input_ids"])
        self.trained = sum(sum(x != -100 for x in labels) for labels in ds["labels"])

    def step(self) -> float:
        t, model = self.trainer, self.trainer.model
        batches = list(t.get_train_dataloader())
        num_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        t.current_gradient_accumulation_steps = self.accum
        t0 = time.perf_counter()
        for i, b in enumerate(batches):
            t.accelerator.gradient_state._set_sync_gradients(i == len(batches) - 1)
            t.training_step(model, b, torch.tensor(num_items))
        t._clip_grad_norm(model)
        t.optimizer.step()
        t.lr_scheduler.step()
        model.zero_grad()
        return time.perf_counter() - t0


def _peak_rss_mb() -> float:
    """This process's peak resident memory since its exec (``VmHWM``). Not ``ru_maxrss``: on Linux that
    survives exec, so a child started from a big parent reports the parent's peak."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux


def _checkpoint(a: argparse.Namespace, tmp: str) -> Path:
    if a.hf_checkpoint:
        return Path(a.hf_checkpoint)
    if a.model == "tiny":
        from agentrl.tiny import build_model

        return build_model(Path(tmp) / "tiny", hidden_size=256, num_layers=4)
    from agentrl.checkpoint import resolve_hf_checkpoint

    return Path(resolve_hf_checkpoint(None))


def _side(name: str, ckpt: Path, rows: list[dict], a: argparse.Namespace, tmp: str, budget: int):
    return TrlSide(ckpt, rows, a.micro_batch, tmp) if name == "TRL" else AgentrlSide(ckpt, rows, budget)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "default"], default="tiny")
    p.add_argument("--hf-checkpoint", default=None, help="any local HF checkpoint (overrides --model)")
    p.add_argument("--conversations", type=int, default=16, help="conversations per optimizer step (both sides)")
    p.add_argument("--micro-batch", type=int, default=4, help="TRL per_device_train_batch_size")
    p.add_argument("--max-tokens-per-gpu", type=int, default=4096, help="agentrl packing budget")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    p.add_argument("--memory-only", choices=["agentrl", "TRL"], default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    tmp = tempfile.mkdtemp(prefix="p9_")
    try:
        ckpt = _checkpoint(a, tmp)
        rows = conversations(a.conversations, tmp)
        if a.memory_only:  # a child: this side alone, two steps, then its peak RSS
            side = _side(a.memory_only, ckpt, rows, a, tmp, a.max_tokens_per_gpu)
            side.step(), side.step()
            print(json.dumps({"peak_rss_mb": _peak_rss_mb()}))
            return
        sides = [AgentrlSide(ckpt, rows, a.max_tokens_per_gpu), TrlSide(ckpt, rows, a.micro_batch, tmp)]
        ours, trl = sides
        tokens = sum(ours.lengths)
        print(
            f"model {ckpt}, torch threads {torch.get_num_threads()}; {len(rows)} conversations/step, {tokens} tokens "
            f"({ours.trained} assistant tokens trained); TRL: {sum(trl.lengths)} tokens ({trl.trained} trained)"
        )
        extra = [t - o for o, t in zip(ours.lengths, trl.lengths)]
        if ours.trained != trl.trained or any(d not in (0, 1) for d in extra):
            print("WARNING: the two sides do not train the same tokens; the ratio compares different work")
        elif any(extra):  # the template's "\n" after the last end-of-turn, which a rollout never samples
            print(f"TRL's rows carry the template's trailing newline after the last turn ({sum(extra)} tokens in all)")
        for side in sides:
            print(f"warm-up {side.name}: {side.step():.2f}s", flush=True)
        ratios, rates = [], {s.name: [] for s in sides}
        for r in range(a.reps):
            for side in sides if r % 2 == 0 else sides[::-1]:
                rates[side.name].append(tokens / side.step())
            ratios.append(rates[ours.name][-1] / rates["TRL"][-1])
            print(
                f"rep {r}: agentrl {rates[ours.name][-1]:.1f} tok/s, TRL {rates['TRL'][-1]:.1f} tok/s, "
                f"ratio {ratios[-1]:.2f}",
                flush=True,
            )
        del sides, ours, trl
        peaks = {}
        for name in ("agentrl", "TRL"):
            cmd = [
                sys.executable,
                __file__,
                "--memory-only",
                name,
                "--conversations",
                str(a.conversations),
                "--micro-batch",
                str(a.micro_batch),
                "--max-tokens-per-gpu",
                str(a.max_tokens_per_gpu),
            ]
            cmd += ["--hf-checkpoint", str(ckpt)] + (["--threads", str(a.threads)] if a.threads else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            peaks[name] = json.loads(out)["peak_rss_mb"]
        print(
            f"P9 SFT train tokens/s (agentrl torch, {a.max_tokens_per_gpu}-token packed micro-batches / TRL "
            f"SFTTrainer, micro-batch {a.micro_batch}), median of {a.reps}: {statistics.median(ratios):.2f} "
            f"(range {min(ratios):.2f}-{max(ratios):.2f}; goal >= 1.5); peak RSS agentrl {peaks['agentrl']:.0f} MB, "
            f"TRL {peaks['TRL']:.0f} MB"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
