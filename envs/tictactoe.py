"""Tic-tac-toe: two roles in one episode (self-play), or one role against a scripted opponent.

:class:`TicTacToe` declares ``roles = ("x", "o")``: each player has its own conversation (its own
sample in training), sees the board after the other's move, and moves by replying with the number of
a free cell, 1-9 (the reply's last digit from 1 to 9 counts)::

     1 | 2 | X
    ---+---+---
     O | 5 | 6
    ---+---+---
     7 | 8 | 9

Rewards, at the end of the game: win 1.0, draw 0.5 each, loss 0.0. A reply without a free cell's
number forfeits: the mover gets 0.0 and the other player 1.0. X moves first. A task row may add
``legal_move_reward`` (0 to 0.2, default 0): a shaping reward the mover gets for each legal move, the
"format reward" game-playing RL uses to get a model that cannot yet play off the ground (a model that
only ever forfeits gives GRPO nothing to compare). It is added to the result, so with it the reward is
no longer the result (a long draw can reach a short win's 1.0): evaluate on rows without it, where
``--success-threshold 1.0`` (the default) makes pass@1 the win rate.

:class:`TicTacToeVsBot` is the same game for one agent: the model plays X against a scripted O
(``"random"``: a random free cell; ``"greedy"``: win if it can, block if it must, else random;
seeded by the episode's seed), the task row's ``opponent``. The model's reward is its result (plus any
``legal_move_reward``).

Measured with :func:`agentrl.rollout.scripted.play` on ``TicTacToeVsBot.tasks(512, opponent)`` (mean
reward / win rate): :func:`solver_policy` (perfect play by minimax) 1.00 / 0.99 against random, 0.94 /
0.88 against greedy; :func:`last_free_policy` (the highest free cell) 0.81 / 0.80 and 0.10 / 0.00;
:func:`random_policy` (a random free cell) 0.71 / 0.67 and 0.26 / 0.14; text without a digit 0.0.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable
from typing import Any

import agentrl

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
OPPONENTS = ("random", "greedy")
_CELL = re.compile(r"[1-9]")

RULES = (
    "We play tic-tac-toe on cells numbered 1 to 9, left to right, top to bottom. You are {mark}. "
    "On your turn reply with the number of a free cell. Three in a row wins."
)


def legal_move_reward(task: dict[str, Any]) -> float:
    """The task row's ``legal_move_reward`` (a number from 0 to 0.2; 0 when absent), checked."""
    value = task.get("legal_move_reward", 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 0.2:
        raise ValueError(f"a tic-tac-toe task's 'legal_move_reward' must be a number from 0 to 0.2, got {value!r}")
    return float(value)


def render(board: list[str]) -> str:
    """The board as text: free cells show their number."""
    cells = [c if c != " " else str(i + 1) for i, c in enumerate(board)]
    rows = [" " + " | ".join(cells[r * 3 : r * 3 + 3]) for r in range(3)]
    return "\n---+---+---\n".join(rows)


def your_move(board: list[str]) -> str:
    """The board and the free cells, as the player to move sees them (the legal moves are listed, as
    text-game suites such as TextArena do: reading them off is the first thing a small model learns)."""
    free = " ".join(str(i + 1) for i, c in enumerate(board) if c == " ")
    return f"{render(board)}\nFree cells: {free}. Your move."


def winner(board: list[str]) -> str | None:
    """``"X"`` or ``"O"`` with three in a row, else None."""
    for a, b, c in LINES:
        if board[a] != " " and board[a] == board[b] == board[c]:
            return board[a]
    return None


def parse_move(text: str) -> int | None:
    """The cell (0-8) of the reply's last digit from 1 to 9, or None."""
    found = _CELL.findall(text)
    return int(found[-1]) - 1 if found else None


class TicTacToe(agentrl.Env):
    """Self-play: roles ``x`` and ``o``, each its own sample; see the module docstring."""

    roles = ("x", "o")
    max_turns = 9

    @staticmethod
    def tasks(n: int = 64) -> list[dict[str, Any]]:
        """``n`` games from the empty board (the same game: the players' sampling makes them differ)."""
        return [{"prompt": "tic-tac-toe", "label": ""} for _ in range(n)]

    async def reset(self, *, seed: int | None = None, options: dict | None = None):
        self.board = [" "] * 9
        self.turn = "x"
        self.bonus = legal_move_reward(options or {})
        start = your_move(self.board)
        return {
            "x": [{"role": "system", "content": RULES.format(mark="X")}, {"role": "user", "content": start}],
            "o": [
                {"role": "system", "content": RULES.format(mark="O")},
                {"role": "user", "content": "X moves first. Wait for the board."},
            ],
        }, {}

    def current_role(self) -> str:
        return self.turn

    async def step(self, action: agentrl.Action):
        me, other = self.turn, "o" if self.turn == "x" else "x"
        cell = parse_move(action.text)
        info: dict[str, Any] = {"role": me, "cell": None if cell is None else cell + 1}
        if cell is None or self.board[cell] != " ":
            info["forfeit"] = True
            return {}, {me: 0.0, other: 1.0}, True, False, info
        self.board[cell] = me.upper()
        won = winner(self.board)
        if won or " " not in self.board:
            info["result"] = f"{me} wins" if won else "draw"
            result = {me: 1.0, other: 0.0} if won else {me: 0.5, other: 0.5}
            return {}, {me: result[me] + self.bonus, other: result[other]}, True, False, info
        self.turn = other
        shown = f"{me.upper()} played {cell + 1}.\n{your_move(self.board)}"
        return {other: [{"role": "user", "content": shown}]}, {me: self.bonus, other: 0.0}, False, False, info


class TicTacToeVsBot(agentrl.Env):
    """The model plays X against a scripted O (the task's ``opponent``: random or greedy)."""

    max_turns = 5

    @staticmethod
    def tasks(n: int = 64, opponent: str = "random") -> list[dict[str, Any]]:
        return [{"prompt": "tic-tac-toe", "label": "", "opponent": opponent} for _ in range(n)]

    async def reset(self, *, seed: int | None = None, options: dict | None = None):
        options = options or {}
        opponent = options.get("opponent", "random")
        if opponent not in OPPONENTS:
            raise ValueError(f"a TicTacToeVsBot task's 'opponent' must be one of {list(OPPONENTS)}, got {opponent!r}")
        self.opponent, self.rng, self.board = opponent, random.Random(seed), [" "] * 9
        self.bonus = legal_move_reward(options)
        return [
            {"role": "system", "content": RULES.format(mark="X")},
            {"role": "user", "content": your_move(self.board)},
        ], {}

    async def step(self, action: agentrl.Action):
        cell = parse_move(action.text)
        if cell is None or self.board[cell] != " ":
            return [], 0.0, True, False, {"forfeit": True}
        self.board[cell] = "X"
        if winner(self.board):
            return [], 1.0 + self.bonus, True, False, {"result": "win"}
        if " " not in self.board:
            return [], 0.5 + self.bonus, True, False, {"result": "draw"}
        reply = self._bot_move()
        self.board[reply] = "O"
        if winner(self.board):
            return [], self.bonus, True, False, {"result": "loss"}
        if " " not in self.board:
            return [], 0.5 + self.bonus, True, False, {"result": "draw"}
        shown = f"O played {reply + 1}.\n{your_move(self.board)}"
        return [{"role": "user", "content": shown}], self.bonus, False, False, {}

    def _bot_move(self) -> int:
        free = [i for i, c in enumerate(self.board) if c == " "]
        if self.opponent == "greedy":
            for mark in ("O", "X"):  # win if it can, else block
                for i in free:
                    trial = list(self.board)
                    trial[i] = mark
                    if winner(trial) == mark:
                        return i
        return self.rng.choice(free)


@functools.cache
def _best(board: str, mark: str) -> tuple[int, int]:
    """(score for ``mark`` to move: 1 win, 0 draw, -1 loss, best cell) by minimax."""
    cells = list(board)
    won = winner(cells)
    if won:
        return (1 if won == mark else -1), -1
    free = [i for i, c in enumerate(cells) if c == " "]
    if not free:
        return 0, -1
    other = "O" if mark == "X" else "X"
    best = (-2, free[0])
    for i in free:
        cells[i] = mark
        score = -_best("".join(cells), other)[0]
        cells[i] = " "
        if score > best[0]:
            best = (score, i)
    return best


def board_from(messages: list[agentrl.Message]) -> list[str]:
    """The nine cells (``"X"``, ``"O"`` or ``" "``) of the last board the seat was shown: what a scripted policy
    (``agentrl sft --demo-policy``) reads to choose its move."""
    text = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    cells = re.findall(r"[1-9XO]", text.split("\n", 1)[-1] if "played" in text else text)
    return [c if c in "XO" else " " for c in cells[:9]]


def solver_policy(messages: list[agentrl.Message], task: dict[str, Any]) -> str:
    """Perfect play for the side to move (read from the last board shown)."""
    board = board_from(messages)
    mark = "X" if board.count("X") == board.count("O") else "O"
    return str(_best("".join(board), mark)[1] + 1)


def last_free_policy(messages: list[agentrl.Message], task: dict[str, Any]) -> str:
    """The highest free cell: legal, blind to the opponent, and still a win in 80% of games against the
    random opponent. Demonstrations for a warm start (``agentrl sft --demo-policy``) that RL then improves on."""
    board = board_from(messages)
    return str(max(i for i, c in enumerate(board) if c == " ") + 1)


def random_policy(seed: int = 0) -> Callable[[list[agentrl.Message], dict[str, Any]], str]:
    """A random free cell each turn."""

    def policy(messages: list[agentrl.Message], task: dict[str, Any]) -> str:
        board = board_from(messages)
        rng = random.Random(f"{seed}:{len(messages)}:{''.join(board)}")
        return str(rng.choice([i for i, c in enumerate(board) if c == " "]) + 1)

    return policy
