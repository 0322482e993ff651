"""Per-turn credit vs outcome-only GRPO on Wordle: reward per step, same seeds, both arms.

    python bench/per_turn_credit.py --model tiny                 # random-init tiny Llama
    python bench/per_turn_credit.py --model default              # SmolLM2-135M (the local package's)
    python bench/per_turn_credit.py --skip-warm --seeds 3,4      # more seeds from the same warm start

What is measured. Wordle (``agentrl.envs.wordle:Wordle``) pays a reward at every guess (0.02 per newly
revealed letter or position, 0.8 .. 0.4 for a solve at guess 1 .. 6), and an episode lasts 1 to 6
turns. One warm start (``agentrl sft`` on ``agentrl.envs.wordle:solver_policy``'s games of the env's 64
tasks, kept at reward >= 0.5) is trained on by two arms of ``agentrl train``, each once per seed:

- ``outcome``: GRPO on the episode's summed reward, one advantage for every token of the episode;
- ``per_turn``: ``--per-turn-credit``: the tokens of turn t get the return from turn t on
  (discounted by ``--gamma``) minus a baseline (``agentrl.algo.advantages.per_turn_grpo``).

For a seed both arms get the same ``--seed`` and ``--rollout-seed`` (the embedded engine draws
concurrent requests from one generator, so even the first rollouts do not match token for token).
The curve is ``reward_mean`` (the mean episode reward of the step's rollout) per step, read from
``<run>/metrics.jsonl``; ``final`` is its mean over the last ``--last`` steps and seeds.

Why. A per-turn baseline that pools the returns of every turn of the group contains the sample's
own returns, and how many depends on when its actions ended the episode: with non-zero
intermediate rewards that is a hidden bonus or penalty for taking another turn (verl issue 7244).
``per_turn_grpo`` now uses a leave-one-out baseline at the same turn index (the mean return at
turn t of the *other* samples of the group that reached turn t) and divides by the spread of the
batch's other groups, both built from independent episodes only. This script measures whether
per-turn credit, so built, learns faster than outcome-only credit on Wordle (whose turn count
varies once the model solves games; the tiny model's games nearly all last 6 turns).

Outputs: ``<out>/per_turn_credit.json`` (per arm: per-seed curves, mean curve, final, seconds),
``<out>/per_turn_credit.png`` (mean per arm with a min-max band over seeds), a table on stdout,
and the runs themselves (``<out>/warm``, ``<out>/<arm>_s<seed>``). RL samples the same 64 secrets
the warm start saw: this measures credit assignment, not generalization.

``--max-response-len`` (tokens per turn, default 48; the solver's turns are ~10): a turn that
reaches it ends the episode (``truncated``) and earns 0 for that turn.

Measured (2-core EPYC, run alone, ``--model tiny`` with the defaults: 60 warm-start steps, 3 seeds
x 2 arms x 30 steps of 8 x 4): 44 s warm start, 94-128 s per RL run (~2 s a step, the rest Ray and
engine start-up), 12 min in all. Both arms went from ~0.009 to 0.030 (final, last 5 steps; seeds
0.028-0.031), step for step within each other's seed range: see bench/README.md. ``--model
default`` is estimated at ~1 min a step (SmolLM2-135M trains at ~120 tokens/s here), i.e. hours.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # for agentrl.tiny, as the other bench scripts do
from bench.main_job import agentrl  # noqa: E402

ENV = ["--env", "agentrl.envs.wordle:Wordle"]
ARMS: dict[str, list[str]] = {"outcome": [], "per_turn": ["--per-turn-credit"]}
# (warm-start steps, warm-start lr, RL lr) per model; the tiny one starts from random weights
DEFAULTS: dict[str, tuple[int, float, float]] = {"tiny": (60, 3e-3, 1e-4), "default": (4, 5e-5, 2e-5)}


def plot(results: dict[str, dict], title: str, png: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for arm, r in results.items():
        curves = list(r["curves"].values())  # [seeds][steps]
        xs = range(1, len(r["mean"]) + 1)
        (line,) = ax.plot(
            xs, r["mean"], marker="o" if len(r["mean"]) < 3 else None, label=f"{arm} (final {r['final']:.3f})"
        )
        ax.fill_between(
            xs, [min(c) for c in zip(*curves)], [max(c) for c in zip(*curves)], color=line.get_color(), alpha=0.2
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward_mean (episode reward)")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(png, format="png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(DEFAULTS), default="tiny")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated; both arms run every seed")
    p.add_argument("--steps", type=int, default=30, help="RL steps per run")
    p.add_argument("--out", default="runs/per_turn_credit")
    p.add_argument("--skip-warm", action="store_true", help="reuse <out>/warm")
    p.add_argument("--warm-steps", type=int, help="SFT steps (default: tiny 60, default 4)")
    p.add_argument("--warm-batch", type=int, default=16, help="demonstrations per SFT step")
    p.add_argument("--warm-lr", type=float, help="default: tiny 3e-3, default 5e-5")
    p.add_argument("--lr", type=float, help="RL lr (default: tiny 1e-4, default 2e-5)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per RL step (--rollout-batch-size)")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (group size)")
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--max-response-len", type=int, default=48, help="tokens per turn")
    p.add_argument("--last", type=int, default=5, help="steps averaged into 'final'")
    a = p.parse_args()
    warm_steps, warm_lr, lr = (
        given if given is not None else default
        for given, default in zip((a.warm_steps, a.warm_lr, a.lr), DEFAULTS[a.model])
    )
    out = Path(a.out) if Path(a.out).is_absolute() else REPO / a.out
    out.mkdir(parents=True, exist_ok=True)
    warm = out / "warm"
    seconds: dict[str, float] = {}
    if not a.skip_warm:
        base: list[str] = []
        if a.model == "tiny":
            from agentrl.tiny import build_model

            base = ["--hf-checkpoint", str(build_model(out / "tiny_model"))]
        shutil.rmtree(warm, ignore_errors=True)
        seconds["warm"] = agentrl(
            "sft",
            *ENV,
            *base,
            "--demo-policy",
            "agentrl.envs.wordle:solver_policy",
            "--demo-min-reward",
            "0.5",
            "--num-rollout",
            str(warm_steps),
            "--global-batch-size",
            str(a.warm_batch),
            "--lr",
            str(warm_lr),
            "--save",
            str(warm),
        )
    seeds = [int(s) for s in a.seeds.split(",")]
    results: dict[str, dict] = {arm: {"curves": {}, "seconds": {}} for arm in ARMS}
    for seed in seeds:  # interleaved (outcome, per_turn, outcome, ...): machine noise hits both arms alike
        for arm, flags in ARMS.items():
            run = out / f"{arm}_s{seed}"
            shutil.rmtree(run, ignore_errors=True)
            results[arm]["seconds"][seed] = round(
                agentrl(
                    "train",
                    *ENV,
                    "--hf-checkpoint",
                    str(warm),
                    "--seed",
                    str(seed),
                    "--rollout-seed",
                    str(seed),
                    "--num-rollout",
                    str(a.steps),
                    "--rollout-batch-size",
                    str(a.prompts),
                    "--n-samples-per-prompt",
                    str(a.samples),
                    "--global-batch-size",
                    str(a.prompts * a.samples),
                    "--lr",
                    str(lr),
                    "--gamma",
                    str(a.gamma),
                    "--rollout-max-turn-len",
                    str(a.max_response_len),
                    "--save",
                    str(run),
                    *flags,
                ),
                1,
            )
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
            results[arm]["curves"][seed] = [r["reward_mean"] for r in sorted(rows, key=lambda r: r["step"])]
    for r in results.values():
        curves = list(r["curves"].values())  # [seeds][steps]
        r["mean"] = [sum(c) / len(c) for c in zip(*curves)]
        r["final"] = sum(r["mean"][-a.last :]) / len(r["mean"][-a.last :])
    summary = {
        "model": a.model,
        "seeds": seeds,
        "steps": a.steps,
        "prompts": a.prompts,
        "samples": a.samples,
        "warm_steps": warm_steps,
        "warm_lr": warm_lr,
        "lr": lr,
        "gamma": a.gamma,
        "last": a.last,
        "warm_seconds": round(seconds["warm"], 1) if "warm" in seconds else None,
        "arms": results,
    }
    (out / "per_turn_credit.json").write_text(json.dumps(summary, indent=2))
    plot(
        results,
        f"Wordle, {a.model} model: {len(seeds)} seeds x {a.prompts}x{a.samples} samples/step",
        out / "per_turn_credit.png",
    )
    print(f"\n{'arm':<10} {'first':>7} {'final':>7} {'min..max final per seed':>24} {'s/run':>7}")
    for arm, r in results.items():
        per_seed = [sum(c[-a.last :]) / len(c[-a.last :]) for c in r["curves"].values()]
        print(
            f"{arm:<10} {r['mean'][0]:7.3f} {r['final']:7.3f} {min(per_seed):11.3f}..{max(per_seed):<12.3f}"
            f" {sum(r['seconds'].values()) / len(seeds):7.1f}"
        )
    print(f"wrote {out / 'per_turn_credit.json'} and {out / 'per_turn_credit.png'}")


if __name__ == "__main__":
    main()
