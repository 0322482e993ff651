"""``agentrl view``: one self-contained HTML page that shows samples token by token.

Exact token accounting is only worth something if people can look at it. The page colours every
token by where it came from (prompt; sampled by the policy = trained, ``loss_mask`` 1; written by the
environment, a tool or the chat template = ``loss_mask`` 0), and each token's tooltip gives its id,
rollout log-prob and advantage. A header per sample shows index, group, status and why, reward,
per-turn rewards, turns, weight versions and the error of a failed sample.

Why the page renders in the browser instead of here: 1,000 samples of 1,000 tokens are a million
spans. Written out as HTML with a tooltip each, that is ~100 MB a browser chokes on. Instead the
page embeds the samples as compact JSON (ids, mask, log-probs) plus a table of the token ids that
occur (id -> text), draws only the headers on load, and builds a sample's token spans when it is
expanded. One delegated click listener serves all headers; tooltips are ``title`` attributes, so no
token has a listener. Search builds each sample's decoded text once, on first use.

Why the token table holds bytes rather than ``decode([id])``: byte-level BPE splits a multi-byte
character over several tokens, and decoding one id alone gives U+FFFD. The table maps each id to its
exact bytes (a string where they are valid UTF-8, else a list of byte values); the page decodes
each sample as a stream, so a split character appears on the token that completes it and the
tokens before it show their raw bytes (``\\xe4``). Spaces, newlines, tabs and control characters
are drawn visibly. Everything from the file goes through one escape function (tokens can hold
``<script>``), and the JSON is embedded with ``<``, ``>``, ``&`` written as ``\\u003c`` etc.
"""

from __future__ import annotations

import argparse
import html
import json
import logging
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentrl.checkpoint import resolve_hf_checkpoint
from agentrl.types import Sample

log = logging.getLogger(__name__)

_SHOWN_META = ("turn_rewards", "num_turns", "status_reason", "error")
_META_CHARS = 8000  # metadata shown per sample, so env_infos cannot blow up the page


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-character map, which byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.decoder is not None:
        return "ByteLevel" in str(backend.decoder)
    return hasattr(tokenizer, "byte_decoder")  # slow GPT-2 style tokenizers


def token_table(tokenizer: Any, ids: Iterable[int]) -> tuple[dict[str, str | list[int]], list[int]]:
    """Map each id to its exact bytes: a str when they are valid UTF-8, else a list of byte values.

    Returns ``(table, special_ids)``. Added tokens (``<|im_start|>``) keep their text; byte-level
    pieces (``Ġhello``) go through GPT-2's byte map; SentencePiece pieces turn ``▁`` into a space and
    ``<0xE4>`` into that byte. An id the tokenizer does not know shows as ``<unk:ID>``.
    """
    ids = sorted(set(ids))
    added = {int(i): t for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    special = sorted(i for i, t in added.items() if getattr(t, "special", False)) or list(
        getattr(tokenizer, "all_special_ids", [])
    )
    byte_level = _is_byte_level(tokenizer)
    table: dict[str, str | list[int]] = {}
    for i in ids:
        try:
            piece = tokenizer.convert_ids_to_tokens(i)
        except (IndexError, KeyError, OverflowError, TypeError, ValueError):
            piece = None
        if piece is None:
            raw = f"<unk:{i}>".encode()
        elif i in added:
            raw = str(added[i]).encode()
        elif byte_level and all(c in _BYTE_DECODER for c in piece):
            raw = bytes(_BYTE_DECODER[c] for c in piece)
        elif m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            raw = bytes([int(m.group(1), 16)])
        else:
            raw = piece.replace("▁", " ").encode()
        try:
            table[str(i)] = raw.decode("utf-8")
        except UnicodeDecodeError:
            table[str(i)] = list(raw)
    return table, special


def _num(x: Any) -> Any:
    """A JSON-safe number (4 decimals); NaN/inf become strings, which ``JSON.parse`` accepts."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return x if x is None or isinstance(x, str) else str(x)
    if isinstance(x, float):
        return round(x, 4) if math.isfinite(x) else str(x)
    return x


def _text_of(prompt: Any) -> str:
    if isinstance(prompt, list):
        return "\n".join(
            f"[{m.get('role', '?')}] {m.get('content') or ''}" if isinstance(m, dict) else str(m) for m in prompt
        )
    return "" if prompt is None else str(prompt)


def _record(row: dict[str, Any], i: int) -> dict[str, Any]:
    """The compact per-sample record the page reads (short keys: a million tokens must stay small)."""
    meta = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
    extra = meta.get("extra") if isinstance(meta.get("extra"), dict) else {}
    tokens = [int(t) for t in row.get("tokens") or []]
    n = int(row.get("response_length") or 0)
    mask, lps = row.get("loss_mask"), row.get("rollout_log_probs")
    adv = row.get("advantages", extra.get("advantages"))
    bad = []
    if not 0 <= n <= len(tokens):
        bad.append(f"response_length {n} outside 0..{len(tokens)}")
        n = min(max(n, 0), len(tokens))
    for name, seq in (("loss_mask", mask), ("rollout_log_probs", lps), ("advantages", adv)):
        if isinstance(seq, list) and len(seq) != n and (tokens or seq):
            bad.append(f"len({name})={len(seq)} != response_length={n}")
    if mask is not None:
        mask = [1 if m else 0 for m in list(mask)[:n]] + [1] * max(0, n - len(mask))
    status = row.get("status") or "pending"
    rec: dict[str, Any] = {
        "i": i,
        "idx": row.get("index"),
        "g": row.get("group_index"),
        "st": str(getattr(status, "value", status)),
        "why": meta.get("status_reason"),
        "err": meta.get("error"),
        "r": _reward(row.get("reward")),
        "tr": [_num(x) for x in meta.get("turn_rewards") or []],
        "nt": meta.get("num_turns"),
        "wv": [str(v) for v in row.get("weight_versions") or []],
        "te": row.get("token_exact", True) is not False,
        "t": tokens,
        "p": len(tokens) - n,
        "m": mask,
        "ns": sum(mask) if mask is not None else n,
        "lp": [_num(x) for x in lps] if isinstance(lps, list) else None,
        "adv": [_num(x) for x in adv] if isinstance(adv, list) else _num(adv),
        "x": {k: str(v) for k in ("rollout_id", "step") if (v := row.get(k, extra.get(k))) is not None}
        | _sample_extras(row),
        "bad": "; ".join(bad) or None,
    }
    images, unsafe = _images(row)
    if images:
        rec["img"] = images
    if unsafe:
        rec["bad"] = "; ".join(filter(None, [rec["bad"], f"{unsafe} image(s) not base64 image data URLs (not drawn)"]))
    if row.get("label") is not None:
        label = row["label"]
        rec["lab"] = label if isinstance(label, str) else json.dumps(label, ensure_ascii=False, default=str)
    if not tokens:
        rec["txt"] = "\n".join(s for s in (_text_of(row.get("prompt")), str(row.get("response") or "")) if s)
    rest = {
        k: v
        for k, v in meta.items()
        if k not in _SHOWN_META and not (k == "extra" and set(v) <= {"advantages", "rollout_id", "step"})
    }
    if rest:
        dumped = json.dumps(rest, ensure_ascii=False, indent=1, default=str)
        rec["meta"] = dumped if len(dumped) <= _META_CHARS else dumped[:_META_CHARS] + "\n… (truncated)"
    return rec


def _sample_extras(row: dict[str, Any]) -> dict[str, str]:
    """slime's control fields worth a glance, only when set: removed from the loss, its own generate
    function, seconds outside the engine, speculative-decoding counters, multimodal inputs."""
    out: dict[str, str] = {}
    if row.get("remove_sample"):
        out["remove_sample"] = "true (trains no token)"
    if row.get("generate_function_path"):
        out["generate_function_path"] = str(row["generate_function_path"])
    t = row.get("non_generation_time")
    if isinstance(t, int | float) and t > 0:
        out["non_generation_time"] = f"{t:.3f}s"
    spec = row.get("spec_info")
    if isinstance(spec, dict) and any(spec.values()):
        out["spec_info"] = json.dumps(spec)
    mm = row.get("multimodal_inputs")
    if isinstance(mm, dict) and isinstance(mm.get("images"), list):
        out["images"] = str(len(mm["images"]))  # drawn in the sample's body
    elif mm is not None:
        out["multimodal_inputs"] = json.dumps(mm, ensure_ascii=False, default=str)[:200]
    return out


_SAFE_IMAGE = re.compile(r"data:image/(png|jpeg|gif|webp);base64,[A-Za-z0-9+/]+={0,2}")
_PLACEHOLDERS = ("<image>", "<|image_pad|>", "<image_soft_token>")
"""Image placeholder tokens of the VLM families' tokenizers: an image is drawn where its run of them starts."""


def _images(row: dict[str, Any]) -> tuple[list[str], int]:
    """The sample's images that are safe to put in an ``<img src>`` (base64 image data URLs), and how many were not."""
    mm = row.get("multimodal_inputs")
    urls = mm.get("images") if isinstance(mm, dict) else None
    if not isinstance(urls, list):
        return [], 0
    ok = [u for u in urls if isinstance(u, str) and _SAFE_IMAGE.fullmatch(u)]
    return ok, len(urls) - len(ok)


def _image_anchors(tokens: list[int], placeholder: int | None, count: int, sizes: Any) -> list[int]:
    """Token positions where each of ``count`` images' placeholders start (empty when they cannot be found).

    ``sizes`` (the sample's ``metadata["image_tokens"]``: placeholders per image) places an image split into
    crops, whose placeholders come in several runs; without it each run is taken for one image."""
    if placeholder is None:
        return []
    at = [j for j, t in enumerate(tokens) if t == placeholder]
    if isinstance(sizes, list) and len(sizes) == count and all(type(n) is int and n > 0 for n in sizes):
        if sum(sizes) != len(at):
            return []
        firsts = [sum(sizes[:k]) for k in range(count)]
        return [at[k] for k in firsts]
    starts = [j for j in at if j == 0 or tokens[j - 1] != placeholder]
    return starts if len(starts) == count else []


def _reward(r: Any) -> Any:
    return json.dumps(r, ensure_ascii=False, default=str) if isinstance(r, (dict, list)) else _num(r)


def render_html(samples: list[dict | Sample], tokenizer: Any, *, title: str = "agentrl samples") -> str:
    """The page for ``samples`` (Sample objects or their JSON dicts) as one self-contained HTML string.

    ``tokenizer`` turns token ids into text (any Hugging Face tokenizer); pass ``None`` to show ids only.
    """
    rows = [s.to_dict() if isinstance(s, Sample) else s for s in samples]
    records = [_record(row, i) for i, row in enumerate(rows)]
    all_ids = {t for r in records for t in r["t"]}
    if tokenizer is None:
        table, special = {str(i): f"[{i}]" for i in all_ids}, []
    else:
        table, special = token_table(tokenizer, all_ids)
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    placeholder = next((vocab[t] for t in _PLACEHOLDERS if t in vocab), None)
    for r, row in zip(records, rows):
        if r.get("img"):
            meta = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
            r["ia"] = _image_anchors(r["t"], placeholder, len(r["img"]), meta.get("image_tokens"))
    data = json.dumps(
        {"vocab": table, "special": special, "samples": records},
        ensure_ascii=False,
        separators=(",", ":"),
        default=str,
        allow_nan=False,
    )
    data = data.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
    fill = {"TITLE": html.escape(title), "DATA": data}
    return re.sub(r"__(TITLE|DATA)__", lambda m: fill[m.group(1)], _TEMPLATE)


def read_samples(path: str | Path, limit: int | None = None) -> tuple[list[dict], int]:
    """The JSON rows of a JSONL file (up to ``limit``) and how many lines were not valid JSON.

    Broken lines are skipped, not fatal: a dump cut short by a crashed run is exactly when one
    wants to look at the samples that did get written.
    """
    rows, broken = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                broken += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                broken += 1
    return rows, broken


def find_run_checkpoint(samples_path: str | Path) -> str | None:
    """``hf_checkpoint`` from a ``config.json``/``config.yaml`` next to the samples (or one folder up).

    Rollout dumps live in a run folder (or its ``rollouts/`` subfolder) whose config names the
    model, so the page decodes with the tokenizer that produced the ids. A key nested one level
    deep (``{"model": {"hf_checkpoint": ...}}``) counts too; a relative path is taken from the
    config's folder when it exists there.
    """
    here = Path(samples_path).resolve().parent
    for folder in (here, here.parent):
        for name in ("config.json", "config.yaml", "config.yml"):
            f = folder / name
            if not f.is_file():
                continue
            try:
                text = f.read_text(encoding="utf-8")
                if name.endswith(".json"):
                    cfg = json.loads(text)
                else:
                    import yaml

                    cfg = yaml.safe_load(text)
            except (OSError, ValueError, ImportError) as exc:
                log.warning("cannot read %s: %s", f, exc)
                continue
            if not isinstance(cfg, dict):
                continue
            nested = [v for v in cfg.values() if isinstance(v, dict)]
            value = next((d["hf_checkpoint"] for d in [cfg, *nested] if d.get("hf_checkpoint")), None)
            if value:
                p = Path(str(value)).expanduser()
                return str(folder / p) if not p.is_absolute() and (folder / p).exists() else str(p)
    return None


def load_tokenizer(samples_path: str | Path, hf_checkpoint: str | None = None) -> Any:
    """The tokenizer of ``--hf-checkpoint``, else of the run's config, else of the default model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_hf_checkpoint(hf_checkpoint or find_run_checkpoint(samples_path)))


def write_view(
    path_in: str | Path,
    path_out: str | Path,
    tokenizer: Any = None,
    limit: int | None = None,
    *,
    hf_checkpoint: str | None = None,
) -> Path:
    """Read a JSONL of samples and write its HTML page; returns ``path_out``.

    Without ``tokenizer`` one is loaded as :func:`load_tokenizer` says.
    """
    path_in, path_out = Path(path_in), Path(path_out)
    rows, broken = read_samples(path_in, limit)
    if broken:
        log.warning("%s: skipped %d line(s) that are not JSON objects", path_in, broken)
    if tokenizer is None:
        tokenizer = load_tokenizer(path_in, hf_checkpoint)
    path_out.parent.mkdir(parents=True, exist_ok=True)
    path_out.write_text(render_html(rows, tokenizer, title=f"{path_in.name} · agentrl view"), encoding="utf-8")
    return path_out


def cmd_view(args: argparse.Namespace) -> int:
    """``agentrl view SAMPLES.jsonl [-o OUT.html] [--hf-checkpoint PATH] [--limit N]``."""
    path_in = Path(args.samples)
    if not path_in.is_file():
        raise FileNotFoundError(f"{path_in}: no such file")
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be >= 1")
    out = write_view(
        path_in, args.output or path_in.with_suffix(".html"), limit=args.limit, hf_checkpoint=args.hf_checkpoint
    )
    print(out)
    return 0


_TEMPLATE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
:root{--p:#e5e7eb;--s:#bbf7d0;--e:#bfdbfe}
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#111;background:#fff}
header{position:sticky;top:0;z-index:1;background:#fafafa;border-bottom:1px solid #ccc;padding:6px 12px}
h1{font-size:16px;margin:0 12px 4px 0;display:inline-block}
.controls,.legend{display:flex;flex-wrap:wrap;gap:6px 12px;align-items:center;margin:3px 0}
#q{width:30em;max-width:90vw}
.legend span{padding:0 6px;border-radius:3px}
.sample{border-bottom:1px solid #e2e2e2}
.hd{cursor:pointer;padding:4px 12px;display:flex;flex-wrap:wrap;gap:2px 14px;align-items:baseline}
.hd:hover{background:#f3f4f6}
.open>.hd{background:#eef2ff}
.st{font-weight:600;padding:0 6px;border-radius:3px;background:#e5e7eb}
.st-completed{background:#dcfce7}.st-truncated{background:#fef9c3}.st-failed,.st-aborted{background:#fecaca}
.badge{font-size:12px;padding:0 5px;border-radius:3px;background:#fde68a}
.errl{color:#b91c1c;max-width:50em;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.dim{color:#6b7280}
.pic{display:inline-block;vertical-align:middle;max-width:256px;max-height:256px;margin:2px 4px;border:2px solid #93c5fd;image-rendering:pixelated}
.bd{padding:4px 12px 12px}
.toks{font:13px/1.7 ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-all}
.toks span{box-shadow:inset -1px 0 rgba(0,0,0,.15)}
.tk-p{background:var(--p);color:#374151}.tk-s{background:var(--s)}.tk-e{background:var(--e)}
.tk-x{font-style:italic;color:#6b7280}.sp{font-weight:700}
pre{white-space:pre-wrap;word-break:break-word;margin:4px 0}
pre.err{background:#fef2f2;border-left:3px solid #dc2626;padding:4px 8px}
[hidden]{display:none!important}
</style></head><body>
<header>
<h1>__TITLE__</h1><span id="summary" class="dim"></span>
<div class="controls">
<input id="q" type="search" placeholder="search text, status:failed, reward:1 … (all words must match)">
<select id="status"><option value="">all statuses</option></select>
<label><input type="checkbox" id="ws" checked> show spaces as ·</label>
<button id="expand">expand shown (first 200)</button><button id="collapse">collapse all</button>
<span id="count" class="dim"></span></div>
<div class="legend"><span class="tk-p">prompt</span><span class="tk-s">sampled · trained (loss_mask 1)</span>
<span class="tk-e">env / tool / template (loss_mask 0)</span><span class="tk-x">\xe4 partial UTF-8 bytes</span>
<span class="sp">special token</span><span class="dim">click a header to expand; hover a token for id, log-prob, advantage</span></div>
</header>
<main id="list"></main>
<script type="application/json" id="agentrl-data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("agentrl-data").textContent);
const V = D.vocab, SP = new Set(D.special), S = D.samples, $ = id => document.getElementById(id);
const list = $("list"), enc = new TextEncoder();
let WS = true;
const ESC = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
const esc = s => String(s).replace(/[&<>"']/g, c => ESC[c]);
const fmt = x => x == null ? "—" : typeof x === "number" ? (Number.isInteger(x) ? String(x) : x.toFixed(3)) : String(x);
const bytesOf = v => typeof v === "string" ? enc.encode(v) : Uint8Array.from(v || []);
const hex = v => Array.from(bytesOf(v), b => "\\x" + b.toString(16).padStart(2, "0")).join("");
// bytes at the end of b that start a UTF-8 character not yet complete
function tail(b) {
  for (let k = 1; k <= 3 && k <= b.length; k++) {
    const c = b[b.length - k];
    if ((c & 0xC0) !== 0x80) { const need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1; return need > k ? k : 0; }
  }
  return 0;
}
// display text per token, decoding the sample as one byte stream; null = bytes of a char completed later
function pieces(ids) {
  const out = new Array(ids.length), dec = new TextDecoder();
  let pend = null;
  for (let j = 0; j < ids.length; j++) {
    const v = V[ids[j]];
    if (typeof v === "string" && !pend) { out[j] = v; continue; }
    let b = bytesOf(v);
    if (pend) { const c = new Uint8Array(pend.length + b.length); c.set(pend); c.set(b, pend.length); b = c; }
    const t = tail(b);
    pend = t ? b.slice(b.length - t) : null;
    out[j] = dec.decode(b.slice(0, b.length - t)) || null;
  }
  return out;
}
function show(s) {
  s = s.replace(/[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]/g, c => "\\x" + c.charCodeAt(0).toString(16).padStart(2, "0"))
       .replace(/\r/g, "␍").replace(/\t/g, "→\t");
  if (WS) s = s.replace(/ /g, "·");
  return s.replace(/\n/g, "↵\n");
}
function pic(r, n) {
  return '<img class="pic" alt="image ' + (n + 1) + '" title="image ' + (n + 1) + '" src="' + esc(r.img[n]) + '">';
}
function tokens(r) {
  const ps = pieces(r.t), out = [], at = new Map((r.ia || []).map((j, n) => [j, n]));
  for (let j = 0; j < r.t.length; j++) {
    if (at.has(j)) out.push(pic(r, at.get(j)));
    const id = r.t[j], k = j - r.p, m = k < 0 ? -1 : r.m ? r.m[k] : 1;
    let cls = m < 0 ? "tk-p" : m ? "tk-s" : "tk-e", txt = ps[j], what = JSON.stringify(txt);
    if (txt === null) { txt = hex(V[id]); what = "bytes " + txt + " (part of a character)"; cls += " tk-x"; }
    if (SP.has(id)) cls += " sp";
    let tip = "#" + j + "  id " + id + "  " + (m < 0 ? "prompt" : m ? "sampled" : "env/tool") + "  " + what;
    if (k >= 0 && r.lp && typeof r.lp[k] === "number") tip += "\nlogp " + r.lp[k].toFixed(4) + " (p " + Math.exp(r.lp[k]).toFixed(3) + ")";
    else if (k >= 0 && r.lp) tip += "\nlogp " + fmt(r.lp[k]);
    if (k >= 0 && r.adv != null) tip += "\nadv " + fmt(Array.isArray(r.adv) ? r.adv[k] : r.adv);
    out.push('<span class="' + cls + '" title="' + esc(tip) + '">' + esc(show(txt)) + "</span>");
  }
  return out.join("");
}
function header(r) {
  const h = ["<b>#" + esc(r.idx ?? r.i) + "</b>"];
  if (r.g != null) h.push('<span class="dim">group</span> ' + esc(r.g));
  h.push('<span class="st st-' + esc(r.st) + '">' + esc(r.st) + "</span>" + (r.why ? ' <span class="dim">' + esc(r.why) + "</span>" : ""));
  h.push('<span class="dim">reward</span> <b>' + esc(fmt(r.r)) + "</b>");
  if (r.tr.length) h.push('<span class="dim">turn rewards</span> [' + esc(r.tr.map(fmt).join(", ")) + "]");
  if (r.nt != null) h.push('<span class="dim">turns</span> ' + esc(r.nt));
  if (r.wv.length) h.push('<span class="dim">weights</span> ' + esc(r.wv.join(", ")));
  const n = r.t.length - r.p;
  h.push('<span class="dim">tokens</span> ' + r.p + " + " + n + " (" + r.ns + " sampled, " + (n - r.ns) + " env)");
  for (const [k, v] of Object.entries(r.x)) h.push('<span class="dim">' + esc(k) + "</span> " + esc(v));
  if (r.lab != null) h.push('<span class="dim">label</span> <span title="' + esc(r.lab) + '">' + esc(r.lab.slice(0, 40)) + (r.lab.length > 40 ? "…" : "") + "</span>");
  if (!r.te) h.push('<span class="badge">not token-exact</span>');
  if (r.bad) h.push('<span class="badge" title="' + esc(r.bad) + '">bad token accounting</span>');
  if (r.err) h.push('<span class="errl" title="' + esc(r.err) + '">' + esc(r.err.trim().split("\n").pop()) + "</span>");
  return h.join("");
}
function body(r) {
  let h = r.err ? '<pre class="err">' + esc(r.err) + "</pre>" : "";
  if (r.bad) h += '<pre class="err">' + esc(r.bad) + "</pre>";
  if (r.img && !(r.ia && r.ia.length && r.t.length)) h += '<div class="pics">' + r.img.map((_, n) => pic(r, n)).join("") + "</div>";
  h += r.t.length ? '<div class="toks">' + tokens(r) + "</div>"
                  : '<div class="dim">no tokens</div>' + (r.txt ? "<pre>" + esc(r.txt) + "</pre>" : "");
  if (r.meta) h += "<details><summary>metadata</summary><pre>" + esc(r.meta) + "</pre></details>";
  return h;
}
function hay(r) {
  if (r._h == null) {
    const text = r.t.length ? pieces(r.t).map((s, j) => s ?? "").join("") : (r.txt || "");
    r._h = [text, "status:" + r.st, "reward:" + fmt(r.r), r.why, r.err, r.lab].join("\n").toLowerCase();
  }
  return r._h;
}
list.innerHTML = S.map((r, i) => '<div class="sample" data-i="' + i + '" data-status="' + esc(r.st) + '"><div class="hd">' + header(r) + "</div></div>").join("");
const EL = Array.from(list.children);
function setOpen(i, open) {
  const el = EL[i];
  let bd = el.querySelector(".bd");
  if (open && !bd) { bd = document.createElement("div"); bd.className = "bd"; bd.innerHTML = body(S[i]); el.appendChild(bd); }
  if (bd) bd.hidden = !open;
  el.classList.toggle("open", open);
}
list.addEventListener("click", e => {
  const hd = e.target.closest(".hd");
  if (hd) { const i = +hd.parentNode.dataset.i; setOpen(i, !EL[i].classList.contains("open")); }
});
function apply() {
  const terms = $("q").value.toLowerCase().split(/\s+/).filter(Boolean), st = $("status").value;
  let shown = 0;
  S.forEach((r, i) => {
    const ok = (!st || r.st === st) && terms.every(t => hay(r).includes(t));
    EL[i].hidden = !ok; shown += ok;
  });
  $("count").textContent = shown + " / " + S.length + " shown";
  const h = new URLSearchParams();
  if ($("q").value.trim()) h.set("q", $("q").value.trim());
  if (st) h.set("status", st);
  if (!WS) h.set("ws", "0");
  history.replaceState(null, "", h.toString() ? "#" + h : location.pathname + location.search);
}
const counts = {};
S.forEach(r => counts[r.st] = (counts[r.st] || 0) + 1);
for (const st of Object.keys(counts).sort()) $("status").add(new Option(st + " (" + counts[st] + ")", st));
const num = S.map(r => r.r).filter(x => typeof x === "number");
$("summary").textContent = S.length + " samples · " + Object.entries(counts).map(([k, v]) => v + " " + k).join(", ") +
  (num.length ? " · mean reward " + (num.reduce((a, b) => a + b, 0) / num.length).toFixed(3) : "");
let timer = 0;
$("q").addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(apply, 200); });
$("status").addEventListener("change", apply);
$("ws").addEventListener("change", () => {
  WS = $("ws").checked;
  EL.forEach((el, i) => { const bd = el.querySelector(".bd"); if (bd) bd.innerHTML = body(S[i]); });
  apply();
});
$("expand").addEventListener("click", () => EL.filter(el => !el.hidden).slice(0, 200).forEach(el => setOpen(+el.dataset.i, true)));
$("collapse").addEventListener("click", () => EL.forEach((el, i) => setOpen(i, false)));
const P = new URLSearchParams(location.hash.slice(1) || location.search.slice(1));
$("q").value = P.get("q") || "";
if (P.get("status") && counts[P.get("status")]) $("status").value = P.get("status");
WS = $("ws").checked = P.get("ws") !== "0";
apply();
const total = S.reduce((a, r) => a + r.t.length, 0);
if (P.get("open") === "all" || (P.get("open") !== "none" && total <= 20000)) EL.forEach((el, i) => el.hidden || setOpen(i, true));
document.body.dataset.ready = "1";
</script></body></html>
"""
