"""GSM8K: grade-school math word problems, solved step by step with the calculator tool.

The data are OpenAI's grade-school-math files (Cobbe et al. 2021, MIT licence, ``data/gsm8k/LICENSE``),
split train (7,473) / test (1,319) as published. Each solution ends with ``#### N``, the reference
answer, and carries calculator annotations ``<<48/2=24>>`` for the arithmetic of each step.

Reward: 1.0 when the last number of the final answer (a turn without a tool call) equals the
reference, else 0; ``info["exact_match"]`` says the same on the final step. ``format_credit`` (0 by
default; :class:`GSM8KFormat` uses 0.1) is added to a wrong final answer written as ``The answer is
N``, for models that first need to learn the format.

Warm starts: the annotations become multi-turn demonstrations, one calculator call per annotation,
the tool's answer, then ``The answer is N.``. :func:`annotation_policy` plays them on the env (for
``agentrl sft --demo-policy agentrl.envs.gsm8k:annotation_policy --demo-min-reward 1``), and
``python -m agentrl.envs.gsm8k --split train --output gsm8k_sft.jsonl`` writes them as OpenAI-format
conversations for ``--sft-data``. Only chains whose last calculator result is the reference answer
earn the reward, so ``--demo-min-reward 1`` keeps exactly the consistent ones.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import agentrl
from agentrl.envs.calculator import Calculator

DATA = Path(__file__).parent / "data" / "gsm8k"
SPLITS = ("train", "test")
_ANNOTATION = re.compile(r"<<([^=<>]+)=([^<>]*)>>")
_ANSWER = re.compile(r"The answer is", re.IGNORECASE)


def reference_answer(solution: str) -> str:
    """The number after ``####`` (commas removed); the whole text if there is no ``####``."""
    text = str(solution)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return text.strip().replace(",", "")


def annotations(solution: str) -> list[str]:
    """The calculator expressions of a GSM8K solution, in order (``<<48/2=24>>`` -> ``48/2``)."""
    return [expr.strip() for expr, _ in _ANNOTATION.findall(str(solution))]


@lru_cache(maxsize=2)
def _read_split(split: str) -> tuple[dict[str, Any], ...]:
    if split not in SPLITS:
        raise ValueError(f"GSM8K split must be one of {SPLITS}, not {split!r}")
    rows = []
    with open(DATA / f"{split}.jsonl", encoding="utf-8") as f:
        for i, line in enumerate(f):
            row = json.loads(line)
            rows.append(
                {
                    "prompt": row["question"],
                    "label": reference_answer(row["answer"]),
                    "answer": row["answer"],
                    "split": split,
                    "id": f"{split}-{i}",
                }
            )
    return tuple(rows)


class GSM8K(Calculator):
    """Solve a GSM8K problem; the calculator tool does the arithmetic, one call per turn if need be."""

    max_turns = 8
    format_credit = 0.0
    system_prompt = (
        "Solve the math word problem step by step. Use the calculator tool for every computation. "
        "When you know the result, reply with: The answer is N."
    )

    @staticmethod
    def tasks(n: int | None = None, seed: int = 0, split: str = "train") -> list[dict]:
        """The first ``n`` problems of ``split`` (all when None), as task rows (prompt, label, answer, id)."""
        rows = _read_split(split)
        return [dict(r) for r in (rows if n is None else rows[:n])]

    async def reset(self, *, seed=None, options=None):
        options = dict(options or {})
        if options.get("label") is not None:  # a raw GSM8K row passed with --label-key answer
            options["label"] = reference_answer(options["label"])
        return await super().reset(seed=seed, options=options)

    async def step(self, action: agentrl.Action):
        obs, reward, terminated, truncated, info = await super().step(action)
        if terminated:
            info = {**info, "exact_match": self.exact(action)}
        return obs, reward, terminated, truncated, info

    async def reward(self, action: agentrl.Action) -> float:
        if self.exact(action):
            return 1.0
        return self.format_credit if _ANSWER.search(action.text) else 0.0


class GSM8KFormat(GSM8K):
    """:class:`GSM8K` with 0.1 for a wrong answer in the ``The answer is N`` format."""

    format_credit = 0.1


def _call(expression: str) -> str:
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"


def annotation_policy(messages: list[dict], task: dict) -> str:
    """Replay the solution's calculator annotations, one call per turn, then answer with the last result.

    Turn k (0-based) calls the k-th annotation; after the last one it answers ``The answer is R.``
    with R the last tool result (so a chain that does not end on the reference earns nothing). A
    solution without annotations is answered with its reference directly.
    """
    exprs = annotations(task.get("answer", ""))
    done = sum(1 for m in messages if m.get("role") == "assistant")
    if done < len(exprs):
        return _call(exprs[done].replace(",", ""))
    last_tool = next((m for m in reversed(messages) if m.get("role") == "tool"), None)
    result = last_tool["content"].strip() if last_tool is not None else task["label"]
    return f"The answer is {result}."


def write_conversations(split: str, output: str | Path, *, limit: int | None = None) -> dict[str, int]:
    """Play :func:`annotation_policy` on ``split`` and write the correct episodes as OpenAI-format rows.

    Each row: ``{"messages": [system, user, assistant(tool_calls), tool(tool_call_id), ..., assistant],
    "tools": [calculator schema], "label": N, "id": ...}``. Returns counts (played, written).
    """
    from agentrl.rollout.scripted import play_sync

    tasks = GSM8K.tasks(limit, split=split)
    results = play_sync(GSM8K, annotation_policy, tasks, max_turns=GSM8K.max_turns, concurrency=32)
    tools = GSM8K().tool_schemas()
    written = 0
    with open(output, "w", encoding="utf-8") as f:
        for r in results:
            if r.error is not None or r.reward < 1.0:
                continue
            f.write(
                json.dumps(
                    {
                        "messages": _openai_messages(r.messages),
                        "tools": tools,
                        "label": r.task["label"],
                        "id": r.task["id"],
                    },
                    ensure_ascii=False,
                )
                + "\n"
            )
            written += 1
    return {"played": len(results), "written": written}


def _openai_messages(messages: list[dict]) -> list[dict]:
    """Played messages in the OpenAI shape: assistant tool calls as ``tool_calls``, results with ``tool_call_id``."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": None, "tool_calls": m["tool_calls"]})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "tool_call_id", "name")})
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m agentrl.envs.gsm8k", description="write GSM8K demonstrations for --sft-data"
    )
    p.add_argument("--split", default="train", choices=SPLITS)
    p.add_argument("--output", required=True)
    p.add_argument("--limit", type=int, default=None, help="only the first N problems")
    a = p.parse_args(argv)
    counts = write_conversations(a.split, a.output, limit=a.limit)
    print(f"{counts['written']} of {counts['played']} problems written to {a.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
