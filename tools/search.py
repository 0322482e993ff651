"""``search``: BM25 retrieval over a local corpus, the tool behind search-augmented QA.

Search-R1-style training needs a retriever that is fast, deterministic and free of network calls,
so that a reward measures the policy and not a flaky web API. A :class:`Corpus` is a list of
documents (``id``, ``title``, ``text``) read from JSONL; its BM25 index (the ``bm25s`` package,
Lucene scoring) is built once, on the first query, and then shared by every episode of the run:
queries only read the index, so concurrent episodes (threads included) need no lock.

The model calls ``search(query, k)`` and reads back the top ``k`` documents, one per line, as
``[id] title: text`` with long texts clipped, best first. Documents scoring zero (no query word in
them) are never returned, so an off-topic query says "no documents match" instead of returning
noise.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import agentrl

__all__ = ["Corpus", "Document", "SearchTool"]

_TOKEN = re.compile(r"\w+")
MAX_QUERY_CHARS = 1000


@dataclass(frozen=True)
class Document:
    """One searchable document. ``id`` is what the model cites; ``title`` is searched with the text."""

    id: str
    title: str
    text: str


class Corpus:
    """Documents plus their BM25 index (built lazily, once, thread-safely).

    Build it from rows (``Corpus(docs)``) or a JSONL file (``Corpus.from_jsonl(path)``, cached per
    file so that every env instance of a run shares one index). Ids must be unique.
    """

    _cache: dict[tuple[str, float], Corpus] = {}
    _cache_lock = threading.Lock()

    def __init__(self, docs: Sequence[Document]) -> None:
        if not docs:
            raise ValueError("a search corpus needs at least one document")
        seen: set[str] = set()
        for d in docs:
            if d.id in seen:
                raise ValueError(f"duplicate document id {d.id!r} in the search corpus")
            seen.add(d.id)
        self.docs: tuple[Document, ...] = tuple(docs)
        self._index: Any = None
        self._build_lock = threading.Lock()

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike[str]) -> Corpus:
        """Read ``{"id", "title", "text"}`` rows (cached by path and modification time)."""
        p = Path(path).expanduser().resolve()
        if not p.is_file():
            raise FileNotFoundError(f"search corpus {p} does not exist")
        key = (str(p), p.stat().st_mtime)
        with cls._cache_lock:
            if key not in cls._cache:
                cls._cache[key] = cls(_read_rows(p))
            return cls._cache[key]

    def __len__(self) -> int:
        return len(self.docs)

    def _bm25(self) -> Any:
        if self._index is None:
            with self._build_lock:
                if self._index is None:
                    import bm25s

                    index = bm25s.BM25()  # Lucene BM25, k1=1.5, b=0.75
                    index.index([tokenize(f"{d.title} {d.text}") for d in self.docs], show_progress=False)
                    self._index = index
        return self._index

    def search(self, query: str, k: int = 3) -> list[tuple[Document, float]]:
        """The ``k`` best documents for ``query`` with their scores, best first; ties by corpus order.

        Only documents that share at least one term with the query are returned (possibly none).
        """
        index = self._bm25()
        ids = [index.vocab_dict[t] for t in tokenize(query) if t in index.vocab_dict]
        if not ids:
            return []
        scores = index.get_scores(ids)  # float32[num_docs]; reads the index, writes nothing shared
        order = np.lexsort((np.arange(len(scores)), -scores))[:k]  # score desc, then doc order
        return [(self.docs[i], float(scores[i])) for i in order if scores[i] > 0]


def tokenize(text: str) -> list[str]:
    """Lowercased runs of letters and digits (years and numbers are searchable words too)."""
    return _TOKEN.findall(text.lower())


def _read_rows(path: Path) -> list[Document]:
    from agentrl.data import read_rows

    docs = []
    for where, row in read_rows(path):
        if not all(isinstance(row.get(k), str) for k in ("id", "title", "text")):
            raise ValueError(f"{where}: expected an object with string 'id', 'title' and 'text'")
        docs.append(Document(row["id"], row["title"], row["text"]))
    return docs


class SearchTool(agentrl.Tool):
    """The ``search`` tool over one :class:`Corpus`: ``query`` (required) and ``k`` (1..``max_k``).

    ``clip`` caps the characters of text shown per document, so that a model asking for many
    results cannot flood its own context window.
    """

    name = "search"
    timeout = 10.0

    def __init__(self, corpus: Corpus, *, default_k: int = 3, max_k: int = 10, clip: int = 400) -> None:
        if not 1 <= default_k <= max_k:
            raise ValueError(f"need 1 <= default_k <= max_k, got default_k={default_k}, max_k={max_k}")
        self.corpus = corpus
        self.default_k, self.max_k, self.clip = default_k, max_k, clip
        self.description = (
            "Search a document collection with keywords. Returns the best-matching documents, one per line, "
            "as '[id] title: text', best first."
        )
        self.parameters = {
            "type": "object",
            "properties": {
                "query": {
                    "type": "string",
                    "description": "keywords to look for, e.g. a name and what you want to know",
                },
                "k": {
                    "type": "integer",
                    "description": f"how many documents to return (1-{max_k}, default {default_k})",
                },
            },
            "required": ["query"],
            "additionalProperties": False,
        }

    async def __call__(self, query: str, k: int | None = None) -> str:
        query = query.strip() if isinstance(query, str) else query
        if not isinstance(query, str) or not query:
            raise agentrl.ToolError("search: 'query' must be a non-empty string of keywords")
        if len(query) > MAX_QUERY_CHARS:
            raise agentrl.ToolError(f"search: 'query' is {len(query)} characters; use at most {MAX_QUERY_CHARS}")
        k = self.default_k if k is None else k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.max_k:
            raise agentrl.ToolError(f"search: 'k' must be an integer from 1 to {self.max_k}, got {k!r}")
        if not tokenize(query):
            raise agentrl.ToolError("search: 'query' has no words in it (only punctuation); use keywords")
        hits = await asyncio.to_thread(self.corpus.search, query, k)
        if not hits:
            return f"No documents match {query!r}. Try other keywords."
        return "\n".join(self._show(doc) for doc, _ in hits)

    def _show(self, doc: Document) -> str:
        text = doc.text if len(doc.text) <= self.clip else doc.text[: self.clip].rstrip() + " ..."
        return f"[{doc.id}] {doc.title}: {text}"
