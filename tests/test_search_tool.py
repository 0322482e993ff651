"""The ``search`` tool: BM25 ranking over a real bm25s index, argument checks, determinism, sharing."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from agentrl.tool import call_tool
from agentrl.tools.search import Corpus, Document, SearchTool

DOCS = [
    Document("d1", "Harbour", "The harbour of the old town holds fishing boats and a lighthouse."),
    Document("d2", "Market", "The market of the old town sells bread, fish and cheese every morning."),
    Document("d3", "Zeppelin works", "Brakkenfold built the first zeppelin of the valley in 1871 near the old town."),
    Document("d4", "Mill", "The mill grinds wheat for the bakers of the town. " + "Flour dust fills the air. " * 40),
]


@pytest.fixture(scope="module")
def tool() -> SearchTool:
    return SearchTool(Corpus(DOCS), default_k=2, max_k=5, clip=120)


async def test_the_doc_with_the_rare_query_words_ranks_first(tool):
    out = await tool(query="who built the zeppelin", k=3)
    lines = out.splitlines()
    assert lines[0].startswith("[d3] Zeppelin works: Brakkenfold built the first zeppelin")
    assert len(lines) == 3  # "the"/"built" also match others; k caps the count
    assert (await tool(query="brakkenfold")).splitlines() == [lines[0]]  # only d3 contains the word
    assert (await tool(query="1871")).startswith("[d3]")  # numbers are searchable terms


async def test_default_k_clipping_and_no_match(tool):
    out = await tool(query="town")
    assert len(out.splitlines()) == 2  # default_k
    mill = (await tool(query="flour wheat mill")).splitlines()[0]
    assert mill.startswith("[d4] Mill: ") and mill.endswith(" ...") and len(mill) < len("[d4] Mill: ") + 120 + 5
    assert (await tool(query="submarine quasar")) == "No documents match 'submarine quasar'. Try other keywords."


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({}, "missing required argument 'query'"),
        ({"query": 42}, "argument 'query' must be a string, got integer 42"),
        ({"query": "   "}, "'query' must be a non-empty string"),
        ({"query": "?!."}, "has no words in it"),
        ({"query": "x" * 1001}, "use at most 1000"),
        ({"query": "town", "k": 0}, "'k' must be an integer from 1 to 5, got 0"),
        ({"query": "town", "k": -3}, "from 1 to 5, got -3"),
        ({"query": "town", "k": 10**9}, "from 1 to 5, got 1000000000"),
        ({"query": "town", "k": "2"}, "argument 'k' must be an integer, got string '2'"),
        ({"query": "town", "k": 1.5}, "argument 'k' must be an integer"),
        ({"query": "town", "limit": 2}, "unknown argument 'limit'"),
    ],
)
async def test_bad_arguments_become_errors_the_model_can_read(tool, arguments, message):
    result = await call_tool(tool, arguments, timeout=5)
    assert result.is_error and result.content.startswith("Error: ")
    assert message in result.content


async def test_a_whole_number_k_given_as_float_is_accepted(tool):
    result = await call_tool(tool, {"query": "town", "k": 3.0}, timeout=5)
    assert not result.is_error and len(result.content.splitlines()) == 3


async def test_deterministic_and_ties_keep_corpus_order():
    corpus = Corpus([Document(f"x{i}", "same", "identical words here") for i in range(5)])
    tool = SearchTool(corpus, max_k=5)
    outs = {await tool(query="identical words", k=5) for _ in range(3)}
    assert len(outs) == 1
    assert [line[:4] for line in outs.pop().splitlines()] == ["[x0]", "[x1]", "[x2]", "[x3]", "[x4]"]


def test_index_is_built_once_and_shared_by_concurrent_threads():
    corpus = Corpus([Document(f"n{i}", f"Entity {i}", f"entity number token{i} lives here") for i in range(300)])
    errors, results = [], {}

    def worker(i: int) -> None:
        try:
            results[i] = corpus.search(f"token{i}", 1)[0][0].id
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(0, 300, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == {i: f"n{i}" for i in range(0, 300, 10)}
    index = corpus._index
    corpus.search("entity", 3)
    assert corpus._index is index


async def test_concurrent_tool_calls_agree_with_sequential_ones(tool):
    queries = ["zeppelin", "fish", "lighthouse", "cheese", "wheat"] * 8
    together = await asyncio.gather(*(tool(query=q, k=1) for q in queries))
    alone = [await tool(query=q, k=1) for q in queries]
    assert together == alone
    assert [t[:4] for t in together[:5]] == ["[d3]", "[d2]", "[d1]", "[d2]", "[d4]"]


def test_from_jsonl_reads_rows_caches_and_refuses_bad_files(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"id": d.id, "title": d.title, "text": d.text}) + "\n" for d in DOCS) + "\n")
    corpus = Corpus.from_jsonl(path)
    assert len(corpus) == 4 and corpus.docs[2].title == "Zeppelin works"
    assert Corpus.from_jsonl(str(path)) is corpus  # one index per file for the whole run
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "title": "t", "text": "x"}\n{"id": "b", "text": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected an object with string 'id', 'title' and 'text'"):
        Corpus.from_jsonl(bad)
    bad.write_text('{"id": "a", "title": "t", "text": "x"}\n{"id": "a", "title": "u", "text": "y"}\n')
    with pytest.raises(ValueError, match="duplicate document id 'a'"):
        Corpus.from_jsonl(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Corpus.from_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="at least one document"):
        Corpus([])
    with pytest.raises(ValueError, match="default_k <= max_k"):
        SearchTool(corpus, default_k=20, max_k=10)


def test_schema_is_what_the_model_sees(tool):
    spec = tool.schema()["function"]
    assert spec["name"] == "search" and spec["parameters"]["required"] == ["query"]
    assert set(spec["parameters"]["properties"]) == {"query", "k"}
    assert "1-5" in spec["parameters"]["properties"]["k"]["description"]
