"""The README's main job, measured: held-out accuracy before / after the warm start / after GRPO.

    python bench/main_job.py [--out runs/main_job] [--skip-train]

Runs, in order, exactly the README's commands (``examples/calculator_agent/``):

1. ``agentrl eval`` of the default model on ``envs/data/calculator_test.jsonl`` (200 problems never
   used for SFT or RL; greedy, up to 3 turns of 64 tokens);
2. ``agentrl sft --config examples/calculator_agent/sft.yaml`` (the warm start), then the same eval;
3. ``agentrl train --config examples/calculator_agent/grpo.yaml`` (GRPO from the warm start), then the
   same eval.

Each eval reports exact-answer accuracy (pass@1 at temperature 0), the fraction of episodes with a
tool call the parser read, and mean turns. The results go to ``<out>/main_job.json`` and a bar chart
to ``<out>/main_job.png`` (the README's picture is a copy). ``--skip-train`` only evaluates and
draws, for run folders that exist already. Minutes each on 2 CPU cores; run it alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HELD_OUT = REPO / "envs" / "data" / "calculator_test.jsonl"
EVAL = [
    "--env",
    "agentrl.envs.calculator:Calculator",
    "--eval-prompt-data",
    "heldout",
    str(HELD_OUT),
    "--rollout-temperature",
    "0",
    "--max-turns",
    "3",
    "--rollout-max-turn-len",
    "64",
]


def agentrl(*args: str, env: dict[str, str] | None = None) -> float:
    """Run ``python -m agentrl ARGS`` in the repo (``env``: the child's environment); its seconds."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "agentrl", *args], cwd=REPO, env=env, check=True)
    return time.monotonic() - t0


def evaluate(checkpoint: str | None, out: Path, name: str, *extra: str, env: dict[str, str] | None = None) -> dict:
    """The README's held-out eval (``EVAL`` plus ``extra`` flags) of a checkpoint (None: the default model)."""
    path = out / f"eval_{name}.json"
    agentrl(
        "eval", *EVAL, *(["--hf-checkpoint", checkpoint] if checkpoint else []), *extra, "--output", str(path), env=env
    )
    r = json.loads(path.read_text())["heldout"]
    return {
        "accuracy": r["pass@1"],
        "tool_call_rate": r["tool_call_rate"],
        "turns_mean": r["turns_mean"],
        "problems": r["num_prompts"],
    }


def plot(results: dict, png: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(results)
    fig = Figure(figsize=(7, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = range(len(names))
    for off, key, label in ((-0.2, "accuracy", "exact answer (greedy)"), (0.2, "tool_call_rate", "tool-call rate")):
        vals = [results[n][key] for n in names]
        bars = ax.bar([x + off for x in xs], vals, width=0.4, label=label)
        ax.bar_label(bars, labels=[f"{v:.3f}" for v in vals], fontsize="small")
    ax.set_xticks(list(xs), names)
    ax.set_ylim(0, 1.12)
    ax.set_title(f"SmolLM2-135M on {results[names[0]]['problems']} held-out calculator problems")
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, format="png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/main_job")
    p.add_argument("--skip-train", action="store_true")
    a = p.parse_args()
    out = (REPO / a.out) if not Path(a.out).is_absolute() else Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {"default model": evaluate(None, out, "base")}
    seconds = {}
    if not a.skip_train:
        seconds["warm start"] = agentrl("sft", "--config", "examples/calculator_agent/sft.yaml")
    results["after warm start"] = evaluate("runs/calculator_warm", out, "warm")
    if not a.skip_train:
        seconds["grpo"] = agentrl("train", "--config", "examples/calculator_agent/grpo.yaml")
    results["after GRPO"] = evaluate("runs/calculator_agent", out, "grpo")
    summary = {
        "results": results,
        "train_seconds": seconds,
        "rl_adds_points": round(100 * (results["after GRPO"]["accuracy"] - results["after warm start"]["accuracy"]), 1),
    }
    (out / "main_job.json").write_text(json.dumps(summary, indent=2))
    plot(results, out / "main_job.png")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
