"""What a training run writes and shows: JSONL metrics, a reward curve, console progress, rollout dumps.

One :class:`MetricsLogger` per run. Every ``log(step, metrics)`` call

- appends one JSON line to ``run_dir/metrics.jsonl`` and flushes it, so a killed run keeps every
  line it wrote (keys sorted; NaN and infinities written as ``null``; ``step`` and ``time``, unix
  seconds, added);
- forwards the numbers to TensorBoard and/or Weights & Biases when asked (both imported lazily, so
  neither is a dependency of the SDK);
- redraws ``run_dir/reward_curve.png`` (every ``plot_every`` steps and at ``close``);
- advances a rich progress bar on a terminal, or prints one plain line to stderr otherwise
  (CI logs, ``nohup``, pytest)::

      step 3/20 reward 0.41 ± 0.2 len 56 rollout 12.1s train 8.0s elapsed 1m02s eta 5m10s

Steps are 0-based (slime's ``rollout_id``) in the files; the console counts finished steps, so
step 2 shows as ``step 3/20``.

:func:`step_metrics` turns a rollout's samples (and the trainer's metrics) into the standard line;
:func:`dump_rollout` writes the samples themselves for ``agentrl view``; :func:`plot_rewards` draws
the curve from any ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from agentrl.types import Sample, Status, episode_units

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "reward_curve.png"
TRAINABLE = (Status.COMPLETED, Status.TRUNCATED)


# -- the standard per-step line -------------------------------------------------------------------


def scalar_reward(sample: Sample) -> float | None:
    """The sample's reward as a float: ``None`` reward counts as 0.0; a dict reward (slime allows
    them for custom reward models) has no single value and gives ``None``."""
    r = sample.reward
    if r is None:
        return 0.0
    if isinstance(r, dict) or isinstance(r, bool):
        return None
    return float(r)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _std(xs: Sequence[float]) -> float:
    """Population standard deviation (ddof=0, as GRPO's group normalization uses); NaN when empty."""
    if not xs:
        return math.nan
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def step_metrics(
    samples: Sequence[Sample],
    *,
    rollout_seconds: float,
    train_metrics: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The standard metrics line of one step, from its rollout samples and the trainer's metrics.

    Per-episode statistics (an episode in several segments counts once, each role of a multi-role
    episode once, roles on a fixed engine not at all; ``reward_mean/<role>`` per role and ``reward_mean/<policy>`` per
    trained ``--policy``; ``reward_*``,
    ``response_length_mean`` (per sample), ``turns_mean``,
    ``tool_calls_mean``, ``tool_call_rate``: the fraction with at least one parsed tool call) are
    taken over **trainable** samples only (completed or truncated): a
    failed or aborted sample has no real reward (the env raised, the engine died), and counting it
    as 0 would make an infrastructure fault look like a worse policy. How many there were is in
    ``count_failed`` / ``count_aborted``; ``count_extra_segments`` (samples beyond one per episode),
    ``count_history_rewrites`` and ``count_template_breaks`` say how often histories were rewritten
    and re-rendered differently; ``partial_resumes`` / ``partial_tokens_saved`` (``--partial-rollout``):
    turns continued after an engine abort, and the sampled tokens a restart would have sampled again. With no trainable sample these means are NaN (``null`` in
    the JSONL). Costs (``sampled_tokens``, ``rollout_tokens_per_s``, ``non_generation_time_mean``: seconds
    in env/tool calls) and counts (``count_remove_sample``: samples a filter kept out of the loss) are
    over all samples; ``spec_accept_rate``/``spec_accept_length`` appear when speculative decoding ran
    (ratios of the batch's summed counters: accepted / drafted tokens, completion tokens / verify
    steps; slime logs per-sample means instead, which weigh a short sample like a long one).

    ``train_metrics`` (``kl``, ``entropy``, ``clipfrac``, ``grad_norm``, ``loss``,
    ``train_seconds``, ``tokens_per_s`` ...) and ``extra`` are merged in unchanged, so they keep
    whatever prefix the caller gave them.
    """
    # an episode in several segments (a history rewrite) counts once: its reward is on every segment,
    # its turns and tool calls are the sum of its segments'
    # roles played by a fixed policy (--role-engine-url) are not the policy's results: left out of these
    episodes = episode_units(samples)
    trainable = [e for e in episodes if e[-1].status in TRAINABLE and e[-1].trained]
    rewards = [r for r in (scalar_reward(e[-1]) for e in trainable) if r is not None]
    turns = [sum(int(s.metadata.get("num_turns", 0)) for s in e) for e in trainable]
    calls = [sum(int(s.metadata.get("tool_calls", 0)) for s in e) for e in trainable]
    sampled = sum(sum(s.loss_mask or ()) for s in samples)
    out: dict[str, Any] = {
        "samples": len(samples),
        "reward_mean": _mean(rewards),
        "reward_std": _std(rewards),
        "reward_max": max(rewards) if rewards else math.nan,
        "reward_min": min(rewards) if rewards else math.nan,
        "response_length_mean": _mean([s.response_length for e in trainable for s in e]),
        "turns_mean": _mean(turns),
        "tool_calls_mean": _mean(calls),
        "tool_call_rate": _mean([float(c > 0) for c in calls]),
        "sampled_tokens": sampled,
        "non_generation_time_mean": _mean([s.non_generation_time for s in samples]),
        "count_not_token_exact": sum(not s.token_exact for s in samples),
        "count_remove_sample": sum(s.remove_sample for s in samples),
        "count_extra_segments": len(samples) - len(episodes),
        "count_history_rewrites": sum(int(s.metadata.get("history_rewrites", 0)) for s in samples),
        "count_template_breaks": sum(int(s.metadata.get("template_breaks", 0)) for s in samples),
        "partial_resumes": sum(int(s.metadata.get("partial_resumes", 0)) for s in samples),
        "partial_tokens_saved": sum(int(s.metadata.get("partial_tokens_saved", 0)) for s in samples),
        "rollout_seconds": float(rollout_seconds),
        "rollout_tokens_per_s": sampled / rollout_seconds if rollout_seconds > 0 else math.nan,
    }
    drafted = sum(s.spec_info.spec_draft_token_num for s in samples)
    if drafted:  # speculative decoding ran (SGLang with a draft model): slime's acceptance statistics
        verified = sum(s.spec_info.spec_verify_ct for s in samples)
        out["spec_accept_rate"] = sum(s.spec_info.spec_accept_token_num for s in samples) / drafted
        out["spec_accept_length"] = (
            sum(s.spec_info.completion_token_num for s in samples) / verified if verified else 0.0
        )
    roles = sorted({e[-1].role for e in trainable if e[-1].role is not None})
    for role in roles:  # an env with roles: each trained role's own mean (self-play averages to the game's value)
        mine = [scalar_reward(e[-1]) for e in trainable if e[-1].role == role]
        out[f"reward_mean/{role}"] = _mean([r for r in mine if r is not None])
    # several trained policies (--policy): each policy's mean over the seats it played
    policies = sorted({e[-1].policy for e in trainable if e[-1].policy is not None})
    for policy in policies:
        mine = [scalar_reward(e[-1]) for e in trainable if e[-1].policy == policy]
        out[f"reward_mean/{policy}"] = _mean([r for r in mine if r is not None])
    for status in (Status.COMPLETED, Status.TRUNCATED, Status.FAILED, Status.ABORTED):
        out[f"count_{status.value}"] = sum(s.status == status for s in samples)
    out.update(train_metrics or {})
    out.update(extra or {})
    return out


# -- rollout dumps --------------------------------------------------------------------------------


def rollout_path(run_dir: str | Path, step: int) -> Path:
    """Where :func:`dump_rollout` writes step ``step``: ``run_dir/rollouts/rollout_{step:06d}.jsonl``."""
    return Path(run_dir) / "rollouts" / f"rollout_{step:06d}.jsonl"


def dump_rollout(
    run_dir: str | Path,
    step: int,
    samples: Sequence[Sample],
    advantages: Sequence[Sequence[float] | None] | None = None,
) -> Path:
    """Write one step's samples, one :meth:`Sample.to_json`-style line each, for ``agentrl view``.

    Each line is the sample's fields plus ``step`` and, when given, ``advantages`` (one value per
    response token, aligned with ``loss_mask``; a ``None`` row, for a sample that was not trained
    on, writes no ``advantages`` key). The file is written to a temporary name and
    renamed, so a viewer never reads half a rollout.
    """
    if advantages is not None:
        if len(advantages) != len(samples):
            raise ValueError(f"{len(advantages)} advantage rows for {len(samples)} samples")
        for s, adv in zip(samples, advantages):
            if adv is not None and len(adv) != s.response_length:
                raise ValueError(f"sample {s.index}: {len(adv)} advantages for response_length {s.response_length}")
    path = rollout_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i, s in enumerate(samples):
            d = s.to_dict()
            d["step"] = step
            if advantages is not None and advantages[i] is not None:
                d["advantages"] = [float(a) for a in advantages[i]]
            f.write(json.dumps(d, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


# -- the reward curve -----------------------------------------------------------------------------


def read_metrics(metrics_jsonl: str | Path) -> list[dict[str, Any]]:
    """The lines of a ``metrics.jsonl``; a torn last line (the run was killed mid-write) is skipped."""
    rows = []
    with open(metrics_jsonl, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    return rows


def _smooth(ys: Sequence[float], weight: float = 0.8) -> list[float]:
    """TensorBoard's debiased exponential moving average: s_t = w s_{t-1} + (1-w) y_t, / (1 - w^t)."""
    out, acc = [], 0.0
    for t, y in enumerate(ys, 1):
        acc = weight * acc + (1 - weight) * y
        out.append(acc / (1 - weight**t))
    return out


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, m, s = s // 3600, s % 3600 // 60, s % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def plot_rewards(metrics_jsonl: str | Path, out_png: str | Path, key: str = "reward_mean") -> Path:
    """Draw ``key`` against step from a ``metrics.jsonl`` into a PNG.

    The raw values, a ±std band (from ``reward_std``, or ``<name>_std`` for a ``<name>_mean``
    key) and a smoothed line (TensorBoard's EMA, weight 0.8); the title gives the wall time from
    the first to the last line's ``time``. Drawn on matplotlib's Agg canvas without pyplot, so it
    never opens a window and can run in any thread. Written to a temporary name and renamed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in read_metrics(metrics_jsonl) if isinstance(r.get(key), (int, float))]
    rows.sort(key=lambda r: r["step"])
    std_key = "reward_std" if key == "reward_mean" else key.removesuffix("_mean") + "_std"
    xs = [r["step"] for r in rows]
    ys = [float(r[key]) for r in rows]
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if rows:
        stds = [float(r.get(std_key) or 0.0) for r in rows]
        if any(stds):
            ax.fill_between(
                xs,
                [y - s for y, s in zip(ys, stds)],
                [y + s for y, s in zip(ys, stds)],
                alpha=0.2,
                linewidth=0,
                label="± std",
            )
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, alpha=0.5, label=key)
        if len(xs) >= 3:
            ax.plot(xs, _smooth(ys), linewidth=2, label="smoothed")
        ax.legend(loc="best", fontsize="small")
    times = [r["time"] for r in rows if isinstance(r.get("time"), (int, float))]
    title = f"{key}: {len(rows)} steps"
    if len(times) >= 2:
        title += f", wall time {_duration(max(times) - min(times))}"
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out


# -- the logger -----------------------------------------------------------------------------------


def _jsonable(v: Any) -> Any:
    """A metric value as JSON: finite numbers as is, NaN/inf as None, tensors/numpy scalars as float."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f if math.isfinite(f) else None


def _fmt(v: Any, spec: str) -> str:
    return "nan" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def _metric_parts(metrics: dict[str, Any]) -> list[str]:
    """``reward 0.41 ± 0.2``, ``len 56``, ``rollout 12.1s``, ``train 8.0s``: those whose metric is present."""
    parts = []
    if "sft_loss" in metrics and "reward_mean" not in metrics:
        parts.append(f"loss {_fmt(metrics['sft_loss'], '.4g')}")
    if "reward_mean" in metrics:
        r = f"reward {_fmt(metrics['reward_mean'], '.3g')}"
        if "reward_std" in metrics:
            r += f" ± {_fmt(metrics['reward_std'], '.2g')}"
        parts.append(r)
    for key, label, spec in (
        ("response_length_mean", "len", ".0f"),
        ("rollout_seconds", "rollout", ".1f"),
        ("train_seconds", "train", ".1f"),
    ):
        if key in metrics:
            parts.append(f"{label} {_fmt(metrics[key], spec)}" + ("s" if key.endswith("seconds") else ""))
    return parts


def format_step(step: int, metrics: dict[str, Any], total_steps: int | None = None) -> str:
    """The console line of one step: ``step 3/20 reward 0.41 ± 0.2 len 56 rollout 12.1s train 8.0s``.

    Parts whose metric is missing are left out; ``step`` is shown 1-based (finished steps).
    """
    head = f"step {step + 1}/{total_steps}" if total_steps else f"step {step + 1}"
    return " ".join([head, *_metric_parts(metrics)])


class MetricsLogger:
    """Writes, forwards and shows the metrics of a training run (see the module docstring).

    ``run_dir=None`` writes no files (console and the trackers only). ``resume_step`` is the first
    step a resumed run will log again: lines with ``step >= resume_step`` are dropped from an
    existing ``metrics.jsonl`` (see :meth:`truncate_after`) and TensorBoard purges its events from
    that step, so the resumed curves have no duplicates. ``plot_every`` redraws the reward curve
    every N steps (0: only at :meth:`close`). ``stream`` (default stderr) is where the console goes;
    the progress bar is used only when it is a terminal.
    """

    def __init__(
        self,
        run_dir: str | Path | None,
        *,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str | None = None,
        config: dict[str, Any] | None = None,
        console: bool = True,
        total_steps: int | None = None,
        resume_step: int | None = None,
        plot_every: int = 1,
        stream: TextIO | None = None,
        curve_key: str = "reward_mean",
    ):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.curve_key = curve_key  # what the curve shows: reward_mean (RL) or loss (a warm start)
        self.curve_file = CURVE_FILE if curve_key == "reward_mean" else f"{curve_key}_curve.png"
        self.total_steps = total_steps
        self.plot_every = plot_every
        self._tb = self._wandb = None
        self._file: TextIO | None = None
        self._progress = self._bar = None
        self._stream = stream if stream is not None else sys.stderr
        self._console = console
        self._t0 = time.monotonic()
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._dirty = False
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                self.truncate_after(resume_step)
            self._file = open(self.metrics_path, "a", encoding="utf-8")
        if tensorboard:
            self._tb = _tensorboard_writer(self.run_dir, resume_step)
        if wandb:
            self._wandb = _wandb_run(self.run_dir, wandb_project, config)
        if console and _isatty(self._stream):
            self._start_progress(resume_step or 0)

    @property
    def metrics_path(self) -> Path:
        assert self.run_dir is not None
        return self.run_dir / METRICS_FILE

    def truncate_after(self, step: int) -> int:
        """Drop the lines of ``metrics.jsonl`` whose step is ``>= step``; return how many were kept.

        Called with the first step a resumed run will redo. Torn lines (a kill mid-write) go too.
        The file is rewritten under a temporary name and renamed, so a crash here loses nothing.
        """
        if self.run_dir is None or not self.metrics_path.exists():
            return 0
        kept = [r for r in read_metrics(self.metrics_path) if r["step"] < step]
        reopen = self._file is not None
        if reopen:
            self._file.close()
        tmp = self.metrics_path.with_name(METRICS_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in kept:
                f.write(json.dumps(r, sort_keys=True, allow_nan=False) + "\n")
        os.replace(tmp, self.metrics_path)
        if reopen:
            self._file = open(self.metrics_path, "a", encoding="utf-8")
        return len(kept)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step's metrics everywhere (file, trackers, console, curve)."""
        clean = {k: _jsonable(v) for k, v in metrics.items() if k not in ("step", "time")}
        if self._file is not None:
            line = json.dumps({**clean, "step": step, "time": time.time()}, sort_keys=True, allow_nan=False)
            self._file.write(line + "\n")
            self._file.flush()
            self._dirty = True
        numbers = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)
        if self._first_step is None:
            self._first_step = step
        self._last_step = step
        if self._console:
            self._show(step, metrics)
        if self.plot_every and (step + 1) % self.plot_every == 0:
            self.plot()

    def plot(self) -> Path | None:
        """Redraw ``run_dir/reward_curve.png`` (``loss_curve.png`` for a warm start) from the file; a plotting error is logged, not raised."""
        if self.run_dir is None or not self._dirty:
            return None
        try:
            out = plot_rewards(self.metrics_path, self.run_dir / self.curve_file, key=self.curve_key)
        except Exception as exc:  # a broken plot must never stop training
            log.warning("could not draw %s: %s: %s", self.curve_file, type(exc).__name__, exc)
            return None
        self._dirty = False
        return out

    def close(self) -> None:
        """Draw the final curve and close the file, the trackers and the progress bar."""
        self.plot()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- console ----------------------------------------------------------------------------------

    def _timing(self, step: int) -> str:
        """``elapsed 1m02s eta 5m10s``: the ETA extrapolates this process's seconds per step."""
        elapsed = time.monotonic() - self._t0
        text = f"elapsed {_duration(elapsed)}"
        done = step + 1 - (self._first_step or 0)
        if self.total_steps and done > 0:
            text += f" eta {_duration(elapsed / done * max(self.total_steps - step - 1, 0))}"
        return text

    def _start_progress(self, completed: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn
        from rich.table import Column

        step = "step {task.completed:.0f}" + ("/{task.total:.0f}" if self.total_steps else "")
        self._progress = Progress(
            TextColumn(step, table_column=Column(no_wrap=True, min_width=len(format_step(0, {}, self.total_steps)))),
            BarColumn(bar_width=20, table_column=Column(min_width=20, no_wrap=True)),
            TextColumn("{task.fields[info]}", table_column=Column(no_wrap=True)),  # cut at the edge, bar kept
            console=Console(file=self._stream),
            transient=False,
        )
        self._progress.start()
        self._bar = self._progress.add_task("train", total=self.total_steps, completed=completed, info="")

    def _show(self, step: int, metrics: dict[str, Any]) -> None:
        if self._progress is not None:  # the bar's own column shows "step i/n"
            parts = _metric_parts(metrics)  # reward first, then the clock: a narrow terminal cuts the rest
            info = " ".join(parts[:1] + [self._timing(step)] + parts[1:])
            self._progress.update(self._bar, completed=step + 1, info=info)
        else:
            print(f"{format_step(step, metrics, self.total_steps)} {self._timing(step)}", file=self._stream, flush=True)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _tensorboard_writer(run_dir: Path | None, resume_step: int | None) -> Any:
    if run_dir is None:
        raise ValueError("TensorBoard logging needs a run directory")
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            f"TensorBoard logging was asked for but cannot be imported ({exc}); pip install tensorboard"
        ) from exc
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=resume_step)


def _wandb_run(run_dir: Path | None, project: str | None, config: dict[str, Any] | None) -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(
            f"Weights & Biases logging was asked for but wandb is not installed ({exc}); "
            "pip install wandb (or drop the W&B option)"
        ) from exc
    return wandb.init(project=project, config=config, dir=str(run_dir) if run_dir is not None else None)
