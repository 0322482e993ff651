"""Learning proofs for the game with an opponent, in its two forms: the model plays X in tic-tac-toe

- against the scripted random O of ``agentrl/TicTacToeVsBot-v0`` (the opponent inside the env), and
- through the multi-role loop of ``agentrl/TicTacToe-v0``, as O against a fixed X on another engine
  (``--role-engine-url x=URL``: the warm start, served by ``agentrl serve``, recorded but never trained), and
- as two policies trained together (``--policy``: X and O each a LoRA adapter of its own), each then measured
  against the warm start as a fixed opponent (issue 40).

A warm start (SFT on ``last_free_policy`` demonstrations) teaches the move format and a legal strategy;
GRPO then raises the trained role's win rate. Each is measured on the same held-out games (another seed) with the same
``agentrl eval`` command before and after, as a user would.

Opt-in (``-m slow``, about 15 minutes on 2 CPU cores): a 128-wide tiny model (the 64-wide one cannot
learn to read the board in this budget), ~1.5 min of SFT, ~2 min of GRPO per form.

What did not learn (the closing note of issue 13 has the figures): GRPO from the random-init model
(the first move is almost never legal: no reward to compare), and self-play (both roles trained), which on
this model settles into "X plays 3, O repeats it and forfeits" or, from the warm start, into play that
loses every game to the random opponent. Beating a fixed opponent does not carry over to the random one
either: X trained against a fixed O won 0.94 of games against it and 0.06 against the random O.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.policy_eval import agentrl_cli, latest, seat_scores

pytestmark = pytest.mark.slow

ENV = "agentrl/TicTacToeVsBot-v0"
TURN = ["--max-turns", "5", "--rollout-max-turn-len", "24"]


def _rows(path: Path, n: int) -> Path:
    path.write_text(
        "".join(json.dumps({"prompt": "tic-tac-toe", "label": "", "opponent": "random"}) + "\n" for _ in range(n))
    )
    return path


def _win_rate(ckpt: Path, held: Path, out: Path) -> float:
    """The same eval command before and after: the share of held-out games won (reward 1; a draw is 0.5)."""
    agentrl_cli("eval", "--env", ENV, "--hf-checkpoint", str(ckpt), "--eval-prompt-data", "held", str(held),
             "--rollout-seed", "90001", "--output", str(out), *TURN)  # fmt: skip
    return json.loads(out.read_text())["held"]["pass@1"]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory) -> Path:
    from agentrl.tiny import build_model

    out = tmp_path_factory.mktemp("tictactoe")
    model = build_model(out / "model", hidden_size=128, mean_turn_tokens=4.0)
    agentrl_cli("sft", "--env", ENV, "--hf-checkpoint", str(model), "--prompt-data", str(_rows(out / "demos.jsonl", 192)),
             "--demo-policy", "agentrl.envs.tictactoe:last_free_policy", "--num-epoch", "8", "--lr", "3e-3",
             "--global-batch-size", "32", "--rollout-seed", "3", "--save", str(out / "sft"), *TURN)  # fmt: skip
    return latest(out / "sft")


def _grpo(env: str, ckpt: Path, rows: Path, save: Path, *extra: str) -> Path:
    agentrl_cli("train", "--env", env, "--hf-checkpoint", str(ckpt), "--prompt-data", str(rows), "--num-rollout", "24",
             "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--lr", "5e-4", "--global-batch-size", "64",
             "--seed", "7", "--rollout-seed", "7", "--save", str(save), *extra)  # fmt: skip
    return latest(save)


def test_grpo_raises_the_win_rate_a_warm_start_reached(warm_start, tmp_path):
    held = _rows(tmp_path / "held.jsonl", 256)
    before = _win_rate(warm_start, held, tmp_path / "before.json")
    after = _win_rate(
        _grpo(ENV, warm_start, _rows(tmp_path / "train.jsonl", 128), tmp_path / "rl", *TURN), held, tmp_path / "a.json"
    )
    print(
        f"win rate against the random opponent on 256 held-out games: warm start {before:.3f}, after GRPO {after:.3f}"
    )
    assert before > 0.2, before  # the warm start plays legal moves (a random-init model wins none)
    assert after > before + 0.1, (before, after)  # measured: 0.324 -> 0.578, 0.352 -> 0.570


def test_the_trained_role_beats_a_fixed_opponent_on_another_engine(warm_start, tmp_path):
    """O (trained, from the warm start) against X fixed to the warm start: the warm start wins nearly every
    game as X (it moves first), so O starts near 0 and must learn to block."""
    from agentrl.engines.local.process import local_server

    games = tmp_path / "games.jsonl"
    games.write_text("".join(json.dumps({"prompt": "tic-tac-toe", "label": ""}) + "\n" for _ in range(256)))
    train_rows = tmp_path / "train.jsonl"
    train_rows.write_text("".join(json.dumps({"prompt": "tic-tac-toe", "label": ""}) + "\n" for _ in range(128)))
    turns = ["--max-turns", "9", "--rollout-max-turn-len", "24"]
    with local_server(warm_start, log_path=tmp_path / "x.log", extra_args=["--seed", "0"], startup_timeout=120) as url:
        vs_x = ["--role-engine-url", f"x={url}", *turns]

        def o_wins(ckpt: Path, out: Path) -> float:  # the fixed X's samples are left out: pass@1 is O's win rate
            agentrl_cli("eval", "--env", "agentrl/TicTacToe-v0", "--hf-checkpoint", str(ckpt), "--eval-prompt-data",
                     "held", str(games), "--rollout-seed", "90001", "--output", str(out), *vs_x)  # fmt: skip
            return json.loads(out.read_text())["held"]["pass@1"]

        before = o_wins(warm_start, tmp_path / "before.json")
        after = o_wins(
            _grpo("agentrl/TicTacToe-v0", warm_start, train_rows, tmp_path / "rl", *vs_x), tmp_path / "a.json"
        )
    lines = [json.loads(line) for line in open(tmp_path / "rl" / "metrics.jsonl")]
    print(f"O's win rate against the fixed X on 256 held-out games: warm start {before:.3f}, after GRPO {after:.3f}")
    assert all(line["dropped_fixed_role"] > 0 and "reward_mean/x" not in line for line in lines)  # X never trained
    assert after > before + 0.2, (before, after)  # measured: 0.024 -> 0.518


def test_two_policies_trained_together_against_each_other(warm_start, tmp_path):
    """Issue 40: X and O as two policies (``--policy x_player --policy o_player``, a LoRA adapter each on the warm
    start) trained together on shared games, each seat on its own adapter. Each policy is then measured against the
    warm start as a fixed opponent on another engine, with the same ``agentrl eval`` command before (the fresh
    adapters, which start as the warm start) and after (the run's adapters): an engine serving both adapters by name
    (``--lora-paths``), the policy's seat named by ``--role-policy``, the other seat on ``--role-engine-url``.

    Measured (one run, seed 7, LoRA r32, lr 5e-3, 24 steps): O 0.098 -> 0.417 of the games against the fixed X; X
    0.879 -> 0.344 against the fixed O. What did not learn: X. The warm start already wins nearly every game as X
    against itself (it moves first); trained against an O that learns to block, X's play stops carrying over to the
    warm start's O (in training, reward_mean/x_player fell 0.89 -> 0.23 as O's rose 0.11 -> 0.47). So only O's
    gain is asserted."""
    from agentrl.config import TrainConfig
    from agentrl.trainer.torch_trainer import TorchTrainer

    lora = ["--lora-rank", "32", "--lora-alpha", "32"]
    games = tmp_path / "games.jsonl"
    games.write_text("".join(json.dumps({"prompt": "tic-tac-toe", "label": ""}) + "\n" for _ in range(256)))
    train_rows = tmp_path / "train.jsonl"
    train_rows.write_text("".join(json.dumps({"prompt": "tic-tac-toe", "label": ""}) + "\n" for _ in range(128)))
    turns = ["--max-turns", "9", "--rollout-max-turn-len", "24"]
    policies = ["--policy", "x_player", "--policy", "o_player", "--role-policy", "x=x_player"]
    policies += ["--role-policy", "o=o_player", "--weight-sync", "adapter", *lora, "--lr", "5e-3"]
    fresh = tmp_path / "fresh"  # the adapters a run starts from (B = 0: the warm start itself)
    TorchTrainer(warm_start, TrainConfig(lora_rank=32, lora_alpha=32, policy=["x_player", "o_player"])).save(fresh)
    after = _grpo("agentrl/TicTacToe-v0", warm_start, train_rows, tmp_path / "rl", *policies, *turns)

    def win_rates(adapters: Path, tag: str) -> dict[str, float]:
        seats = {"x": "x_player", "o": "o_player"}
        return seat_scores("agentrl/TicTacToe-v0", warm_start, adapters, seats, games, tmp_path, tag, turns)

    before, later = win_rates(fresh, "before"), win_rates(after, "after")
    lines = [json.loads(line) for line in open(tmp_path / "rl" / "metrics.jsonl")]
    print(
        f"against the warm start as a fixed opponent, 256 held-out games: X policy {before['x']:.3f} -> "
        f"{later['x']:.3f}, O policy {before['o']:.3f} -> {later['o']:.3f}; in training, reward_mean/x_player "
        f"{lines[0]['reward_mean/x_player']:.3f} -> {lines[-1]['reward_mean/x_player']:.3f}, reward_mean/o_player "
        f"{lines[0]['reward_mean/o_player']:.3f} -> {lines[-1]['reward_mean/o_player']:.3f}"
    )
    assert all(line["grad_norm/x_player"] >= 0 and line["grad_norm/o_player"] >= 0 for line in lines)
    assert later["o"] > before["o"] + 0.1, (before, later)
