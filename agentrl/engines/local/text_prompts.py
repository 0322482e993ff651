"""Text prompts to token ids for the embedded engine's routes, bounded before the tokenizer runs.

``/generate`` ``text``, ``/v1/completions`` string prompts and rendered ``/v1/chat/completions``
conversations are tokenized here. Tokenizing is the expensive part of a large text request: a 16 MiB
text takes the tiny test tokenizer ~1 minute and ~3 GB, a model's tokenizer seconds and gigabytes,
all for a prompt the engine then refuses as longer than its context. So:

- A text is refused before it is tokenized when it cannot fit: every token of the vocabulary covers
  at most :attr:`TextPrompts.max_token_chars` characters of the text (its longest vocabulary entry,
  special tokens included), and Unicode normalization (NFC/NFKC, which some tokenizers apply) merges
  at most :data:`NORMALIZATION_SHRINK` characters into one, so ``len(text) // (max_token_chars *
  NORMALIZATION_SHRINK)`` tokens is a lower bound on its length. A tokenizer that drops or collapses
  text (whitespace runs, accents, control characters, unknown characters fused into one token) would
  break that bound: each is tried on such probes at start, and a tokenizer that fails one is never
  refused early (its texts are tokenized and then checked).
- The routes call these in a worker thread for large bodies (the tokenizer's Rust code releases the
  GIL), so ``/health`` and every other request keep being answered meanwhile.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

NORMALIZATION_SHRINK = 4
"""Most characters Unicode normalization turns into one (a canonical decomposition holds at most 4 code points)."""

_PROBE_CHARS = 4096
_PROBES = (" ", "\n", "\t", "\u0301", "\x00", "\u200b", "\ue000", "\U0001f600", "a\u0301")
"""Runs of each (whitespace, a combining accent, a control character, a zero-width space, private use,
an emoji, a letter with an accent): text a tokenizer may drop, collapse or fuse into one unknown token."""


class TextPrompts:
    """Encode text prompts for an engine whose prompts must be shorter than ``context_length`` tokens.

    ``check`` (a callable ``(tokens, at_least=...)``, :meth:`LocalEngine.check_prompt_length`) raises the
    engine's 400 for a prompt that does not fit, so an early refusal reads like the engine's own.
    """

    def __init__(self, tokenizer: Any, check: Any):
        self.tokenizer = tokenizer
        self.check = check
        vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.max_token_chars = max((len(t) for t in vocab if isinstance(t, str)), default=1) or 1
        self.chars_per_token_bound = self.max_token_chars * NORMALIZATION_SHRINK
        self.bounded = all(self._keeps_bound(c) for c in _PROBES)
        if not self.bounded:
            log.info("the tokenizer drops or collapses some text: long text prompts are tokenized before the check")

    def _keeps_bound(self, piece: str) -> bool:
        text = piece * (_PROBE_CHARS // len(piece))
        try:
            n = len(self.tokenizer.encode(text, add_special_tokens=False))
        except Exception:  # noqa: BLE001 - a tokenizer that cannot take it: no early refusal
            return False
        return n >= len(text) // self.chars_per_token_bound

    def check_fits(self, text: str) -> None:
        """Refuse ``text`` (the engine's 400) when even its fewest possible tokens do not fit the context."""
        if self.bounded:
            least = len(text) // self.chars_per_token_bound
            if least:
                self.check(least, at_least=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids (``add_special_tokens`` as the tokenizer's ``encode``), refused first if it cannot fit."""
        self.check_fits(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
