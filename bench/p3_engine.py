"""P3: decode throughput of the embedded engine vs Hugging Face ``generate`` (same model, same run).

Both sides sample at temperature 1 with top-k/top-p disabled and the same ``max_new_tokens``.
Useful tokens only: for HF, each row's tokens up to and including its first EOS (a static batch
keeps computing finished rows until the longest one ends; those tokens are not counted); for the
engine, ``completion_tokens`` (which include the stop token). Throughput = useful tokens / wall time
of the whole call (prefill included on both sides).

  A: 32 requests at once            vs  one HF static batch of 32
  B: 96 requests, 32 running at once vs HF processing them as 3 static batches of 32

Two workloads (``--workload``): ``stories`` ("write a short story about X": the model rarely stops
before the limit, so a static batch wastes little: the worst case for continuous batching) and
``agent`` (the bundled calculator env's first turns, rendered exactly as ``agentrl rollout`` sends
them, tools in the system prompt, with the rollout's default 256-token turn budget: turn lengths
vary as they do in agentic rollouts). Default: both.

Run: ``python bench/p3_engine.py [--hf-checkpoint PATH] [--workload agent]``. Goal: ratio >= 2.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

TOPICS = [
    "the moon",
    "tea",
    "rivers",
    "chess",
    "volcanoes",
    "bread",
    "owls",
    "glass",
    "trains",
    "rain",
    "bees",
    "maps",
    "salt",
    "jazz",
    "ice",
    "paper",
    "copper",
    "kites",
    "deserts",
    "clocks",
    "whales",
    "silk",
    "bridges",
    "coffee",
    "comets",
    "sand",
    "violins",
    "forests",
    "mirrors",
    "wheat",
    "lighthouses",
    "ants",
]


def make_prompts(tok, n: int) -> list[list[int]]:
    """``n`` distinct chat prompts rendered with the model's chat template."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        msg = [{"role": "user", "content": f"Write a short story ({i // len(TOPICS) + 1}) about {topic}."}]
        out.append(tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=True, return_dict=False))
    return [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in out]


async def make_agent_prompts(tok, n: int) -> list[list[int]]:
    """``n`` first-turn prompts of the calculator env, as the episode loop renders them."""
    from agentrl.chat import ChatTemplate
    from agentrl.envs.calculator import Calculator

    template, env = ChatTemplate(tok), Calculator()
    out = []
    for task in Calculator.tasks(n, seed=3):
        obs, _ = await env.reset(options=task)
        out.append(template.prompt(obs, env.tool_schemas())[1])
    return out


def hf_generate(model, tok, prompts: list[list[int]], max_new: int, eos: set[int]) -> tuple[int, float]:
    """One static batch (left-padded) through ``model.generate``; return (useful tokens, seconds)."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos))
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            pad_token_id=pad,
        )
    dt = time.perf_counter() - t0
    useful = 0
    for row in out[:, width:].tolist():
        n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        useful += n
    return useful, dt


async def engine_generate(engine, prompts: list[list[int]], max_new: int) -> tuple[int, float]:
    sp = {"max_new_tokens": max_new, "temperature": 1.0, "top_k": -1, "top_p": 1.0}
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, dict(sp)) for p in prompts))
    return sum(o["meta_info"]["completion_tokens"] for o in outs), time.perf_counter() - t0


def report(label: str, ours: tuple[int, float], hf: tuple[int, float]) -> None:
    a, b = ours[0] / ours[1], hf[0] / hf[1]
    print(
        f"{label}: engine {ours[0]} tok / {ours[1]:.1f}s = {a:.1f} tok/s | "
        f"HF generate {hf[0]} tok / {hf[1]:.1f}s = {b:.1f} tok/s"
    )
    print(f"P3 {label} ratio (engine / HF generate) = {a / b:.2f}  (goal >= 2)")


async def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.checkpoint import resolve_hf_checkpoint
    from agentrl.engines.local import LocalEngine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-checkpoint", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: 128 (stories), 256 (agent)")
    ap.add_argument("--workload", choices=["stories", "agent", "both"], default="both")
    ap.add_argument("--skip-96", action="store_true", help="only run variant A")
    args = ap.parse_args()
    path = resolve_hf_checkpoint(args.hf_checkpoint)
    print(f"model {path}, torch threads {torch.get_num_threads()}")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen_eos = model.generation_config.eos_token_id
    eos = {gen_eos} if isinstance(gen_eos, int) else set(gen_eos or [])
    eos.add(tok.eos_token_id)
    engine = LocalEngine(path, max_running_requests=32, seed=0)
    torch.manual_seed(0)
    workloads = ["stories", "agent"] if args.workload == "both" else [args.workload]
    for name in workloads:
        prompts = make_prompts(tok, 96) if name == "stories" else await make_agent_prompts(tok, 96)
        max_new = args.max_new_tokens or (128 if name == "stories" else 256)
        print(f"workload {name}: max_new_tokens {max_new}")
        hf_generate(model, tok, prompts[:4], 8, eos)  # warm-up both sides
        await engine_generate(engine, prompts[:4], 8)
        engine.flush_cache()
        ours = await engine_generate(engine, prompts[:32], max_new)
        engine.flush_cache()
        hf = hf_generate(model, tok, prompts[:32], max_new, eos)
        report(f"{name} A (32 concurrent)", ours, hf)
        if not args.skip_96:
            ours = await engine_generate(engine, prompts, max_new)
            engine.flush_cache()
            runs = [hf_generate(model, tok, prompts[i : i + 32], max_new, eos) for i in (0, 32, 64)]
            report(f"{name} B (96 requests, 32 at a time)", ours, (sum(r[0] for r in runs), sum(r[1] for r in runs)))
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
