"""GSM8K with the calculator tool: the default model before training, after SFT, after SFT + GRPO.

    python bench/gsm8k_report.py [--out runs/gsm8k] [--problems 500] [--pass-problems 500] [--k 4]
        [--checkpoints base,sft,grpo]

Runs, in order (each step is skipped when its output exists, so an interrupted report resumes):

1. ``python -m agentrl.envs.gsm8k --split train --output <out>/sft.jsonl``: the train split's calculator
   annotations as multi-turn demonstrations (only chains that end on the reference answer);
2. the held-out eval of the default model: the first ``--problems`` problems of GSM8K's **test**
   split, greedy (pass@1), and the first ``--pass-problems`` of them ``--k`` times at temperature
   0.7 (pass@k, Chen et al.'s unbiased estimator); up to 8 turns of 256 tokens each;
3. ``agentrl sft --config examples/gsm8k/sft.yaml`` (8 steps of 16 demonstrations), the same evals;
4. ``agentrl train --config examples/gsm8k/grpo.yaml`` (GRPO on train-split problems), the same evals.

Each eval reports exact-answer accuracy, the fraction of episodes with a tool call the parser read
and mean turns. Results go to ``<out>/gsm8k_report.json``; a Markdown table is printed (the README's
and ``bench/README.md``'s are copies). About 4.5 h on 2 CPU cores for all three rows (the 500 × 4 sampled evals
are ~1 h each); run it alone. ``--checkpoints`` picks rows, so a report can be built in parts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from main_job import REPO, agentrl  # noqa: E402

TEST = REPO / "envs" / "data" / "gsm8k" / "test.jsonl"


def evaluate(checkpoint: str | None, out: Path, name: str, *, problems: int, samples: int, temperature: float) -> dict:
    """One held-out GSM8K eval of ``checkpoint`` (None: the default model), reused when its file exists."""
    path = out / f"eval_{name}.json"
    if not path.exists():
        agentrl(
            "eval",
            "--env",
            "agentrl.envs.gsm8k:GSM8K",
            "--eval-prompt-data",
            "test",
            str(TEST),
            "--input-key",
            "question",
            "--label-key",
            "answer",
            "--num-tasks",
            str(problems),
            "--n-samples-per-eval-prompt",
            str(samples),
            "--rollout-temperature",
            str(temperature),
            "--rollout-max-turn-len",
            "256",
            "--rollout-concurrency",
            "64",
            "--engine-max-running-requests",
            "64",
            *(["--hf-checkpoint", checkpoint] if checkpoint else []),
            "--output",
            str(path),
        )
    r = json.loads(path.read_text())["test"]
    return {k: r[k] for k in r if k.startswith("pass@")} | {
        "tool_call_rate": r["tool_call_rate"],
        "turns_mean": r["turns_mean"],
        "problems": r["num_prompts"],
        "samples": r["num_samples"],
        "truncated": r["count_truncated"],
        "seconds": r["seconds"],
    }


def table(results: dict, k: int) -> str:
    lines = [
        f"| checkpoint | greedy accuracy | tool-call rate | turns | pass@1 (T 0.7) | pass@{k} (T 0.7) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        g, s = r["greedy"], r["sampled"]
        lines.append(
            f"| {name} | {g['pass@1']:.3f} | {g['tool_call_rate']:.2f} | {g['turns_mean']:.1f} "
            f"| {s['pass@1']:.3f} | {s[f'pass@{k}']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/gsm8k")
    p.add_argument("--problems", type=int, default=500, help="test problems for the greedy eval")
    p.add_argument("--pass-problems", type=int, default=500, help="test problems for the sampled pass@k eval")
    p.add_argument("--k", type=int, default=4, help="samples per problem for pass@k")
    p.add_argument(
        "--checkpoints",
        default="base,sft,grpo",
        help="comma-separated rows to train (where missing) and evaluate: base, sft, grpo (grpo trains from sft)",
    )
    a = p.parse_args()
    wanted = {c.strip() for c in a.checkpoints.split(",") if c.strip()}
    if not wanted or wanted - {"base", "sft", "grpo"}:
        p.error(f"--checkpoints: expected a comma-separated subset of base,sft,grpo, got {a.checkpoints!r}")
    out = (REPO / a.out) if not Path(a.out).is_absolute() else Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    demos = out / "sft.jsonl"
    if not demos.exists():
        subprocess.run(
            [sys.executable, "-m", "agentrl.envs.gsm8k", "--split", "train", "--output", str(demos)],
            cwd=REPO,
            check=True,
        )
    seconds: dict[str, float] = {}
    results: dict[str, dict] = {}
    steps = [
        ("default model", "base", None, None, None),
        ("after SFT", "sft", "runs/gsm8k_sft", "sft", "examples/gsm8k/sft.yaml"),
        ("after SFT + GRPO", "grpo", "runs/gsm8k_grpo", "train", "examples/gsm8k/grpo.yaml"),
    ]
    for name, key, ckpt, command, config in steps:
        if (
            key == "sft"
            and "grpo" in wanted
            and not (REPO / "runs/gsm8k_grpo/latest_checkpointed_iteration.txt").exists()
        ):
            # GRPO starts from the SFT checkpoint, so it is trained even when its row is not evaluated.
            if not (REPO / ckpt / "latest_checkpointed_iteration.txt").exists():
                seconds[key] = agentrl(command, "--config", config)
        if key not in wanted:
            continue
        if command and not (REPO / ckpt / "latest_checkpointed_iteration.txt").exists():
            seconds[key] = agentrl(command, "--config", config)
        results[name] = {
            "greedy": evaluate(ckpt, out, f"{key}_greedy", problems=a.problems, samples=1, temperature=0.0),
            "sampled": evaluate(ckpt, out, f"{key}_sampled", problems=a.pass_problems, samples=a.k, temperature=0.7),
        }
    summary = {"results": results, "train_seconds": seconds}
    (out / "gsm8k_report.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print(table(results, a.k))


if __name__ == "__main__":
    main()
