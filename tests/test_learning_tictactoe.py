"""Learning proof for a game against a scripted opponent: the model plays X in tic-tac-toe against the
random O of ``agentrl/TicTacToeVsBot-v0``; a warm start (SFT on ``last_free_policy`` demonstrations)
teaches it the move format and a legal strategy, GRPO then raises its win rate. Both are measured on
the same held-out games (another seed) with the same ``agentrl eval`` command, as a user would.

Opt-in (``-m slow``, about 5 minutes on 2 CPU cores): a 128-wide tiny model (the 64-wide one cannot
learn to read the board in this budget), ~1.5 min of SFT, ~2 min of GRPO.

What did not learn (the closing note of issue 13 has the figures): GRPO from the random-init model
(the first move is almost never legal: no reward to compare), and self-play through the roles loop,
which on this model settles into "X plays 3, O repeats it and forfeits" rather than play that beats
the scripted opponent.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ENV = "agentrl/TicTacToeVsBot-v0"
TURN = ["--max-turns", "5", "--rollout-max-turn-len", "24"]


def _agentrl(*args: str) -> None:
    out = subprocess.run([sys.executable, "-m", "agentrl", *args], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]


def _rows(path: Path, n: int) -> Path:
    path.write_text(
        "".join(json.dumps({"prompt": "tic-tac-toe", "label": "", "opponent": "random"}) + "\n" for _ in range(n))
    )
    return path


def _latest(run: Path) -> Path:
    return run / f"iter_{int((run / 'latest_checkpointed_iteration.txt').read_text()):07d}"


def _win_rate(ckpt: Path, held: Path, out: Path) -> float:
    """The same eval command before and after: the share of held-out games won (reward 1; a draw is 0.5)."""
    _agentrl("eval", "--env", ENV, "--hf-checkpoint", str(ckpt), "--eval-prompt-data", "held", str(held),
             "--rollout-seed", "90001", "--output", str(out), *TURN)  # fmt: skip
    return json.loads(out.read_text())["held"]["pass@1"]


def test_grpo_raises_the_win_rate_a_warm_start_reached(tmp_path):
    from agentrl.tiny import build_model

    model = build_model(tmp_path / "model", hidden_size=128, mean_turn_tokens=4.0)
    held = _rows(tmp_path / "held.jsonl", 256)
    _agentrl("sft", "--env", ENV, "--hf-checkpoint", str(model), "--prompt-data", str(_rows(tmp_path / "demos.jsonl", 192)),
             "--demo-policy", "agentrl.envs.tictactoe:last_free_policy", "--num-epoch", "8", "--lr", "3e-3",
             "--global-batch-size", "32", "--rollout-seed", "3", "--save", str(tmp_path / "sft"), *TURN)  # fmt: skip
    warm = _latest(tmp_path / "sft")
    before = _win_rate(warm, held, tmp_path / "before.json")
    _agentrl("train", "--env", ENV, "--hf-checkpoint", str(warm), "--prompt-data", str(_rows(tmp_path / "train.jsonl", 128)),
             "--num-rollout", "24", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--lr", "5e-4",
             "--global-batch-size", "64", "--seed", "7", "--rollout-seed", "7", "--save", str(tmp_path / "rl"), *TURN)  # fmt: skip
    after = _win_rate(_latest(tmp_path / "rl"), held, tmp_path / "after.json")
    print(
        f"win rate against the random opponent on 256 held-out games: warm start {before:.3f}, after GRPO {after:.3f}"
    )
    assert before > 0.2, before  # the warm start plays legal moves (a random-init model wins none)
    assert after > before + 0.1, (before, after)  # measured: 0.324 -> 0.578
