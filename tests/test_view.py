"""``agentrl view``: the page is checked in a real headless Chromium, not by string matching.

Chromium's ``--dump-dom`` prints the DOM after the page's script ran, so the tests see what a
user sees: token spans per provenance, visible samples after a search from the URL fragment,
and injected markup shown as text instead of executed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest

from agentrl.types import Sample, Status
from agentrl.view import find_run_checkpoint, render_html, token_table, write_view

pytestmark = pytest.mark.e2e  # engine processes, Ray, several processes or a browser: see conftest

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
# CI installs chromium and sets AGENTRL_REQUIRE_BROWSER=1, so there a missing browser fails instead of skipping.
needs_browser = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("AGENTRL_REQUIRE_BROWSER"),
    reason="no chromium/chrome binary on PATH for the headless DOM checks",
)

PWN = "<script>document.body.setAttribute('data-pwned','1')</script><img src=x onerror=\"document.body.setAttribute('data-pwned','2')\">"


def _sample(tok, index: int, turns: list[tuple[str, int]], **kw) -> dict:
    """A Sample dict whose response is ``turns``: (text, mask) pieces, tokenized one by one."""
    prompt = tok.encode("<|im_start|>user\nWhat is 12 plus 30?<|im_end|>\n<|im_start|>assistant\n")
    resp, mask = [], []
    for text, m in turns:
        ids = tok.encode(text)
        resp += ids
        mask += [m] * len(ids)
    s = Sample(
        index=index,
        group_index=index // 2,
        tokens=prompt + resp,
        response_length=len(resp),
        loss_mask=mask,
        rollout_log_probs=[-0.25 if m else 0.0 for m in mask],
        status=Status.COMPLETED,
        **kw,
    )
    s.validate()
    return s.to_dict()


@pytest.fixture(scope="module")
def samples(tiny_tokenizer) -> list[dict]:
    tok = tiny_tokenizer
    multi = _sample(
        tok,
        0,
        [
            ("Let me call 中文 add.<|im_end|>", 1),
            ("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n", 0),
            ("The answer is 42.<|im_end|>", 1),
        ],
        reward=1.0,
        metadata={"turn_rewards": [0.0, 1.0], "num_turns": 2, "status_reason": "env_terminated"},
        weight_versions=["3", "4"],
    )
    multi["advantages"] = [0.5] * multi["response_length"]
    multi["step"] = 7
    xss = _sample(
        tok, 1, [(f"alert(1) {PWN}<|im_end|>", 1)], reward=0.0, metadata={"turn_rewards": [0.0], "num_turns": 1}
    )
    failed = Sample(
        index=2,
        group_index=1,
        prompt=[{"role": "user", "content": "hi <b>there</b>"}],
        status=Status.FAILED,
        metadata={"status_reason": "env_error", "error": "Traceback ...\nValueError: boom <b>bold</b>"},
    ).to_dict()
    inexact = _sample(
        tok,
        3,
        [("The answer is 41.", 1)],
        reward=float("nan"),
        token_exact=False,
        metadata={"status_reason": "max_turns", "num_turns": 1},
    )
    inexact.update(status="truncated", loss_mask=None, rollout_log_probs=[float("-inf")] * inexact["response_length"])
    return [multi, xss, failed, inexact]


class _Dom(HTMLParser):
    """Per sample (``div.sample``): span classes counted, text, hidden/open flags, element tags seen."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: dict[int, dict] = {}
        self.cur, self.depth, self.body_attrs, self.title = None, 0, {}, ""
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body_attrs = a
        self._in_title = tag == "title"
        if tag == "div" and "sample" in (a.get("class") or "").split():
            self.cur, self.depth = int(a["data-i"]), 0
            self.samples[self.cur] = {
                "hidden": "hidden" in a,
                "open": "open" in a["class"].split(),
                "spans": Counter(),
                "text": "",
                "tags": Counter(),
                "titles": [],
            }
        if self.cur is None:
            return
        s = self.samples[self.cur]
        s["tags"][tag] += 1
        if tag == "div":
            self.depth += 1
        if tag == "span":
            s["spans"].update((a.get("class") or "").split())
            s["titles"].append(a.get("title") or "")

    def handle_endtag(self, tag):
        self._in_title = False
        if self.cur is not None and tag == "div":
            self.depth -= 1
            if self.depth == 0:
                self.cur = None

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        if self.cur is not None:
            self.samples[self.cur]["text"] += data


def _browse(html_path: Path, fragment: str, profile: Path) -> _Dom:
    cmd = [
        CHROMIUM,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--dump-dom",
        html_path.as_uri() + fragment,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0 and "<main" in out.stdout, out.stderr[-2000:]
    dom = _Dom()
    dom.feed(out.stdout)
    assert dom.body_attrs.get("data-ready") == "1", "the page's script did not finish"
    return dom


@pytest.fixture(scope="module")
def page(samples, tiny_tokenizer, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("view") / "view.html"
    path.write_text(render_html(samples, tiny_tokenizer, title="run <i>x</i>"), encoding="utf-8")
    return path


def test_token_table_gives_exact_bytes_for_split_characters(tiny_tokenizer):
    ids = tiny_tokenizer.encode("中 <|im_end|>")
    table, special = token_table(tiny_tokenizer, ids + [10**6])
    raw = b"".join(bytes(v) if isinstance(v, list) else v.encode() for v in (table[str(i)] for i in ids))
    assert raw.decode() == "中 <|im_end|>"
    assert any(isinstance(table[str(i)], list) for i in ids), "the tiny BPE splits 中 into byte pieces"
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_end|>") in special
    assert table[str(10**6)] == "<unk:1000000>"


def test_embedded_data_is_strict_json_and_escaped(samples, tiny_tokenizer):
    html = render_html([Sample.from_dict(s) for s in samples[:3]] + [samples[3]], tiny_tokenizer, title="t")
    blob = re.search(r'<script type="application/json" id="agentrl-data">(.*?)</script>', html, re.S).group(1)
    assert "<" not in blob and ">" not in blob
    data = json.loads(blob, parse_constant=lambda c: pytest.fail(f"bare {c} in the page's JSON"))
    assert len(data["samples"]) == 4 and data["samples"][3]["r"] == "nan" and data["samples"][3]["lp"][0] == "-inf"
    assert data["samples"][0]["adv"][0] == 0.5  # Sample.from_dict keeps advantages in metadata["extra"]


@needs_browser
def test_browser_renders_tokens_by_provenance_and_escapes_everything(page, samples, tmp_path):
    dom = _browse(page, "#open=all", tmp_path / "profile")
    assert "data-pwned" not in dom.body_attrs, "injected markup executed"
    assert dom.title == "run <i>x</i>"
    assert sorted(dom.samples) == [0, 1, 2, 3]
    for i, s in enumerate(samples):
        got = dom.samples[i]
        assert got["open"] and not got["hidden"]
        n, mask = s["response_length"], s["loss_mask"] or [1] * s["response_length"]
        want = {"tk-p": len(s["tokens"]) - n, "tk-s": sum(mask), "tk-e": n - sum(mask)}
        assert {k: got["spans"][k] for k in want} == want, i
        assert got["tags"]["script"] == got["tags"]["img"] == 0 and got["tags"]["b"] == 2  # the header's own <b>s
    first = dom.samples[0]
    # each of 中 and 文 is three byte-level tokens: two raw byte pieces, then the token completing the character
    assert "\\xe4\\xb8中\\xe6\\x96文" in first["text"] and first["spans"]["tk-x"] == 4
    assert "completed" in first["text"] and "env_terminated" in first["text"] and "[0, 1]" in first["text"]
    assert "3, 4" in first["text"] and "step 7" in first["text"]
    assert any("logp -0.2500" in t and "adv 0.500" in t for t in first["titles"])
    assert PWN.replace(" ", "·") in dom.samples[1]["text"]  # shown as text (spaces drawn as ·), not run
    failed = dom.samples[2]["text"]
    assert "failed" in failed and "env_error" in failed and "ValueError: boom <b>bold</b>" in failed
    assert "no tokens" in failed and "[user] hi <b>there</b>" in failed
    assert "not token-exact" in dom.samples[3]["text"] and "truncated" in dom.samples[3]["text"]


@needs_browser
@pytest.mark.parametrize(
    "fragment,visible",
    [
        ("#q=%E4%B8%AD%E6%96%87+ADD", {0}),  # decoded across split tokens, case-insensitive, all words
        ("#q=status:failed", {2}),
        ("#status=completed&q=reward:0", {1}),
    ],
)
def test_browser_search_and_status_filter_from_url(page, fragment, visible, tmp_path):
    dom = _browse(page, fragment, tmp_path / "profile")
    assert {i for i, s in dom.samples.items() if not s["hidden"]} == visible


def test_cli_view_writes_page(tiny_ckpt, samples, tmp_path):
    src = tmp_path / "samples.jsonl"
    src.write_text("".join(json.dumps(s) + "\n" for s in samples) + '{"cut short', encoding="utf-8")
    out = tmp_path / "out" / "view.html"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrl",
            "view",
            str(src),
            "-o",
            str(out),
            "--hf-checkpoint",
            str(tiny_ckpt),
            "--limit",
            "3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    blob = re.search(r'id="agentrl-data">(.*?)</script>', out.read_text(encoding="utf-8"), re.S).group(1)
    assert [s["idx"] for s in json.loads(blob)["samples"]] == [0, 1, 2]


def test_run_folder_config_names_the_tokenizer(tiny_ckpt, tiny_tokenizer, samples, tmp_path):
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    (run / "config.yaml").write_text(f"model:\n  hf_checkpoint: {tiny_ckpt}\n")
    src = run / "rollouts" / "step_1.jsonl"
    src.write_text(json.dumps(samples[0]) + "\n")
    assert find_run_checkpoint(src) == str(tiny_ckpt)
    out = write_view(src, run / "view.html")  # loads the tiny tokenizer, never the default model
    blob = re.search(r'id="agentrl-data">(.*?)</script>', out.read_text(encoding="utf-8"), re.S).group(1)
    assert json.loads(blob)["vocab"] == token_table(tiny_tokenizer, samples[0]["tokens"])[0]
