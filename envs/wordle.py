"""Wordle: find a secret 5-letter word in 6 guesses, with per-turn rewards (multi-turn text game).

Each assistant turn makes one guess written as ``<guess>word</guess>`` (the *last* such tag
counts; case is ignored). The environment answers with one mark per letter::

    Guess 2 of 6: CRANE -> G Y - - G
    4 guesses left.

``G`` = right letter, right spot; ``Y`` = in the word, another spot; ``-`` = not in the word (or
not that many times: repeated letters are marked like the original game). A turn without a tag,
with a word that is not 5 letters or not in the word list (``envs/data/wordle_words.txt``, ~1500
common words, which are also the possible secrets) gets an error message and **costs a guess**:
an episode is always at most 6 turns, whatever the model writes, and guessing well is the only
way to save turns. The episode terminates on a solve or after the 6th guess (losing is the game's
end, not a limit, so ``terminated``, never ``truncated``).

Reward per step (the episode reward is their sum, at most 1.0):

- shaping for new information: ``INFO_CREDIT`` (0.02) for each letter of the secret seen for the
  first time (G or Y) and 0.02 for each position whose letter is found (G) for the first time. At
  most 5 letters + 5 positions, so shaping sums to at most 0.2 over an episode;
- on a solve at guess ``t`` (1..6): ``SOLVE_REWARD - SOLVE_DECAY * (t - 1)`` = 0.8 .. 0.4, on top of
  the shaping of that guess (a solve reveals every position, so shaping reaches its full value).

So a first-guess solve of a word with 5 distinct letters sums to exactly 1.0, a solve at guess 6
is worth at least 0.52, and a failed game at most 0.2: any solve beats any non-solve. Invalid
guesses earn 0. Measured with ``agentrl.rollout.scripted.play`` on ``tasks(100)``:
:func:`solver_policy` (keep the words consistent with all feedback, open with ``slate``, then
guess the candidate that splits the rest into the most feedback patterns) solves 100/100 in 3.3
guesses on average, mean reward 0.81 (and 1501 of all 1505 secrets); random words from the list
score ~0.11 (best game 0.18, no solve); random 5-letter strings 0.0.
"""

from __future__ import annotations

import functools
import random
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import agentrl
from agentrl.parsing import last_tag

WORDS_PATH = Path(__file__).parent / "data" / "wordle_words.txt"
MAX_GUESSES = 6
INFO_CREDIT = 0.02
SOLVE_REWARD = 0.8
SOLVE_DECAY = 0.08
FIRST_GUESS = "slate"

_FEEDBACK = re.compile(r"Guess \d+ of \d+: ([A-Z]{5}) -> ([GY-](?: [GY-]){4})")

PROMPT = (
    f"Let's play Wordle. Find the secret 5-letter English word in {MAX_GUESSES} guesses. "
    "Each turn, write one guess as <guess>word</guess> (a common 5-letter word). After each guess you get one mark "
    "per letter: G = right letter in the right spot, Y = in the word but in another spot, - = not in the word. "
    "Invalid guesses (not 5 letters, or not a known word) still use up a guess."
)


@functools.cache
def load_words(path: str | Path = WORDS_PATH) -> tuple[str, ...]:
    """The word list: one lowercase 5-letter word per line (``#`` lines are comments); ValueError on a bad line."""
    words: list[str] = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        word = line.strip().lower()
        if not word or word.startswith("#"):
            continue
        if len(word) != 5 or not word.isascii() or not word.isalpha():
            raise ValueError(f"{path}:{n}: {word!r} is not a 5-letter word")
        words.append(word)
    return tuple(dict.fromkeys(words))


def feedback(guess: str, secret: str) -> str:
    """The five marks for ``guess`` against ``secret``, e.g. ``"GY--G"`` (repeated letters as in Wordle).

    Greens first; then each other letter is ``Y`` while the secret still has an unmatched copy of it.
    """
    marks = ["G" if g == s else "-" for g, s in zip(guess, secret)]
    unmatched = Counter(s for s, m in zip(secret, marks) if m != "G")
    for i, g in enumerate(guess):
        if marks[i] != "G" and unmatched[g] > 0:
            marks[i] = "Y"
            unmatched[g] -= 1
    return "".join(marks)


def parse_guess(text: str, allowed: frozenset[str]) -> tuple[str | None, str | None]:
    """``(word, None)`` for a valid guess in ``text``, else ``(None, error message for the model)``."""
    found = last_tag(text, "guess")
    if found is None:
        return None, "No guess found. Write your guess as <guess>word</guess>."
    word = found.lower()
    shown = word[:20] + ("..." if len(word) > 20 else "")
    if len(word) != 5 or not word.isascii() or not word.isalpha():
        return None, f"{shown!r} is not a 5-letter word."
    if word not in allowed:
        return None, f"{shown!r} is not in the word list."
    return word, None


class Wordle(agentrl.Env):
    """Guess the secret word (the task's ``label``) in 6 tries; rewards in the module docstring."""

    max_turns = MAX_GUESSES

    def __init__(self, words: Sequence[str] | None = None) -> None:
        self.words = tuple(words) if words is not None else load_words()
        self.allowed = frozenset(self.words)

    @staticmethod
    def tasks(n: int = 64, seed: int = 0) -> list[dict[str, Any]]:
        """``n`` games (deterministic for a seed): the rules as prompt, a secret from the word list as label."""
        rng = random.Random(seed)
        return [{"prompt": PROMPT, "label": word} for word in rng.choices(load_words(), k=n)]

    async def reset(self, *, seed: int | None = None, options: dict | None = None):
        self.task = dict(options or {})
        secret = str(self.task.get("label") or "").strip().lower()
        if len(secret) != 5 or not secret.isascii() or not secret.isalpha():
            raise ValueError(
                f"a Wordle task's 'label' must be the secret 5-letter word, got {self.task.get('label')!r}"
            )
        self.secret = secret
        self.allowed = self.allowed | {secret}
        self.guesses = 0
        self.letters_found: set[str] = set()
        self.positions_found: set[int] = set()
        return [{"role": "user", "content": str(self.task.get("prompt") or PROMPT)}], {}

    async def step(self, action: agentrl.Action):
        self.guesses += 1
        left = MAX_GUESSES - self.guesses
        word, error = parse_guess(action.text, self.allowed)
        info: dict[str, Any] = {
            "guess": word,
            "valid": word is not None,
            "solved": word == self.secret,
            "guesses_used": self.guesses,
        }
        if word is None:
            reward, line = 0.0, f"Guess {self.guesses} of {MAX_GUESSES}: invalid. {error}"
        else:
            marks = feedback(word, self.secret)
            reward = self._information(word, marks)
            info["feedback"] = marks
            line = f"Guess {self.guesses} of {MAX_GUESSES}: {word.upper()} -> {' '.join(marks)}"
        if word == self.secret:
            reward += SOLVE_REWARD - SOLVE_DECAY * (self.guesses - 1)
        done = word == self.secret or left == 0
        if done:
            info["secret"] = self.secret
            return [], reward, True, False, info
        plural = "guess" if left == 1 else "guesses"
        return [{"role": "user", "content": f"{line}\n{left} {plural} left."}], reward, False, False, info

    def _information(self, word: str, marks: str) -> float:
        """Shaping for letters and positions this guess revealed for the first time (and record them)."""
        letters = {c for c, m in zip(word, marks) if m != "-"} - self.letters_found
        positions = {i for i, m in enumerate(marks) if m == "G"} - self.positions_found
        self.letters_found |= letters
        self.positions_found |= positions
        return INFO_CREDIT * (len(letters) + len(positions))


# -- scripted policies ------------------------------------------------------------------------------


def history(messages: list[agentrl.Message]) -> list[tuple[str, str]]:
    """``(guess, marks)`` pairs read back from the environment's feedback lines in ``messages``."""
    pairs = []
    for m in messages:
        if m.get("role") == "user":
            pairs += [(g.lower(), marks.replace(" ", "")) for g, marks in _FEEDBACK.findall(str(m.get("content", "")))]
    return pairs


def best_guess(candidates: Sequence[str]) -> str:
    """The candidate whose feedback splits the candidates into the most groups (ties: smallest largest group)."""
    if len(candidates) <= 2:
        return candidates[0]

    def split(word: str) -> tuple[int, int]:
        groups = Counter(feedback(word, secret) for secret in candidates)
        return len(groups), -max(groups.values())

    return max(candidates, key=split)


def solver_policy(messages: list[agentrl.Message], task: dict[str, Any]) -> str:
    """Scripted solver for :func:`agentrl.rollout.scripted.play`; reads only the feedback, never the label."""
    seen = history(messages)
    if not seen:
        return f"<guess>{FIRST_GUESS}</guess>"
    candidates = [w for w in load_words() if all(feedback(g, w) == marks for g, marks in seen)]
    return f"<guess>{best_guess(candidates) if candidates else FIRST_GUESS}</guess>"


def random_policy(seed: int = 0, *, strings: bool = False) -> Callable[[list[agentrl.Message], dict[str, Any]], str]:
    """Baseline: a random word from the list each turn (``strings=True``: random 5-letter strings instead)."""

    def policy(messages: list[agentrl.Message], task: dict[str, Any]) -> str:
        rng = random.Random(f"{seed}:{task.get('label')}:{len(messages)}")
        word = "".join(rng.choices(string.ascii_lowercase, k=5)) if strings else rng.choice(load_words())
        return f"<guess>{word}</guess>"

    return policy
