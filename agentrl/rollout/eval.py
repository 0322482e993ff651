"""Evaluation: n samples per prompt on held-out datasets, reported as mean reward and pass@k.

:func:`evaluate` runs the same episode loop as training (:func:`generate_rollout`), so an env
needs nothing extra to be evaluated; it works with token-exact engines and with the chat-completions
adapter (:class:`~agentrl.engines.http.ChatCompletionsEngine`, for API models: samples are
``token_exact=False``, which is fine for evaluation and counted in ``count_not_token_exact``).

A sample **passes** when it is completed or truncated and its reward is ``>= success_threshold``
(default 1.0: the usual 0/1 correctness reward). Failed and aborted samples count as not passing
(an env crash must not raise pass@k), while ``reward_mean`` is over completed/truncated samples
only, as in training metrics (:func:`agentrl.metrics.step_metrics`); the ``count_*`` keys say how
many samples each status had.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from agentrl.env import Env
from agentrl.metrics import TRAINABLE, scalar_reward, step_metrics
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.rollout.reward import RewardFn
from agentrl.types import Sample, episode_units

log = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``c`` pass (Chen et al., 2021).

    pass@k = 1 - C(n - c, k) / C(n, k), the probability that at least one of k samples drawn
    without replacement from the n passes. Computed as the product
    1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms the huge binomials.
    """
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def ks_for(n: int) -> list[int]:
    """The k reported for n samples per prompt: 1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks if ks[-1] == n else ks + [n]


def passed(sample: Sample, success_threshold: float) -> bool:
    """Whether a sample counts as correct: completed/truncated with reward >= the threshold."""
    if sample.status not in TRAINABLE:
        return False
    r = scalar_reward(sample)
    return r is not None and r >= success_threshold


def score_samples(samples: list[Sample], *, n_samples: int, success_threshold: float = 1.0) -> dict[str, Any]:
    """Mean reward, pass@k (averaged over prompts), turns, tool use and status counts of one dataset's samples.

    An episode in several segments is one attempt; each trained role of a multi-role env attempts on its
    own (pass@k over (prompt, role)), with ``reward_mean/<role>`` per role; a fixed opponent's samples
    (``--role-engine-url``) are not the policy's attempts and are left out."""
    groups: dict[Any, list[Sample]] = defaultdict(list)
    for unit in episode_units(samples):  # an episode in several segments is one attempt: its last has the outcome
        last = max(unit, key=lambda s: s.segment)
        if last.trained:  # a role played by a fixed opponent is not the policy's attempt
            groups[(last.group_index, last.role)].append(last)
    m = step_metrics(samples, rollout_seconds=0.0)
    out: dict[str, Any] = {
        "num_prompts": len({prompt for prompt, _ in groups}),
        "num_samples": sum(len(g) for g in groups.values()),
        "reward_mean": m["reward_mean"],
        "reward_std": m["reward_std"],
        "response_length_mean": m["response_length_mean"],
        "turns_mean": m["turns_mean"],
        "tool_calls_mean": m["tool_calls_mean"],
        # episodes (completed or truncated) with at least one tool call the parser read: is the tool used at all
        "tool_call_rate": m["tool_call_rate"],
    }
    for k in ks_for(n_samples):
        per_prompt = [pass_at_k(len(g), sum(passed(s, success_threshold) for s in g), k) for g in groups.values()]
        out[f"pass@{k}"] = sum(per_prompt) / len(per_prompt) if per_prompt else float("nan")
    out.update({key: v for key, v in m.items() if key.startswith(("count_", "reward_mean/"))})
    return out


async def evaluate(
    ctx: EpisodeContext,
    env_factory: Callable[[], Env] | None,
    datasets: dict[str, list[dict[str, Any]]],
    *,
    n_samples: int,
    success_threshold: float = 1.0,
    custom_reward: RewardFn | None = None,
    args: Any = None,
    on_sample: Callable[[str, Sample], None] | None = None,
    custom_generate: Any = None,
) -> dict[str, dict[str, Any]]:
    """Evaluate on each dataset (name -> task rows, as :func:`load_tasks` reads them); one dict per dataset.

    Runs ``n_samples`` episodes per prompt with the sampling settings of ``ctx.config``
    (temperature included: pass@k for k > 1 needs a temperature above 0). Datasets run one after
    another, so ``seconds`` is each one's own wall time. Each result holds ``reward_mean``,
    ``reward_std``, ``pass@k`` for k in 1, 2, 4, ... and n, ``num_prompts``, ``num_samples``,
    ``count_<status>``, ``count_not_token_exact`` and ``seconds``. ``on_sample(dataset_name,
    sample)`` sees every sample as it finishes (to stream them to a file). ``custom_generate`` replaces
    the env as in training (a batch rollout function is called with ``evaluation=True``, as slime).
    """
    if n_samples < 1:
        raise ValueError("n_samples must be >= 1")
    if n_samples > 1 and ctx.config.rollout_temperature == 0:
        log.warning("evaluating %d samples per prompt at temperature 0: pass@k for k > 1 is pass@1", n_samples)
    ctx = dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, n_samples_per_prompt=n_samples))
    results: dict[str, dict[str, Any]] = {}
    for name, tasks in datasets.items():
        sink = (lambda s, _name=name: on_sample(_name, s)) if on_sample is not None else None
        t0 = time.monotonic()
        samples, _ = await generate_rollout(
            ctx,
            env_factory,
            tasks,
            args=args,
            custom_generate=custom_generate,
            custom_reward=custom_reward,
            on_sample=sink,
        )
        results[name] = score_samples(samples, n_samples=n_samples, success_threshold=success_threshold)
        results[name]["seconds"] = round(time.monotonic() - t0, 3)
    return results


def format_eval(results: dict[str, dict[str, Any]]) -> str:
    """A plain-text table of :func:`evaluate`'s results, one row per dataset."""
    ks = sorted({int(key[5:]) for r in results.values() for key in r if key.startswith("pass@")})
    cols = [
        "dataset",
        "prompts",
        "samples",
        "reward",
        *[f"pass@{k}" for k in ks],
        "tool-call rate",
        "turns",
        "completed",
        "truncated",
        "failed",
        "aborted",
        "seconds",
    ]
    rows = []
    for name, r in results.items():
        rows.append(
            [
                name,
                str(r.get("num_prompts", "")),
                str(r.get("num_samples", "")),
                _num(r.get("reward_mean")),
                *[_num(r.get(f"pass@{k}")) for k in ks],
                _num(r.get("tool_call_rate")),
                _num(r.get("turns_mean")),
                *[str(r.get(f"count_{s}", 0)) for s in ("completed", "truncated", "failed", "aborted")],
                f"{r.get('seconds', 0.0):.1f}",
            ]
        )
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths)))]
    for row in rows:
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def _num(v: Any) -> str:
    return "-" if v is None or v != v else f"{v:.3f}"
