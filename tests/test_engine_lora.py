"""The embedded engine serves LoRA adapters as SGLang does: its flags, endpoints and request fields, several adapters
in one batch, each row exactly what PEFT computes for its adapter, and no KV shared across adapters.

The adapters are made here with PEFT (random B, so each one changes the model) on the tiny local model; the reference
for every log-prob is ``peft.PeftModel`` re-scoring prompt + output in one plain forward.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from agentrl.engines.local import LocalEngine, build_app
from agentrl.engines.local.lora import (
    LoraError,
    check_adapter_config,
    check_limits,
    parse_lora_paths,
    parse_target_modules,
)
from agentrl.engines.local.sampling import InvalidRequestError
from tests.serving import serve_app

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = list(range(5, 29))
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def _make_adapter(base: Path, out: Path, *, seed: int, r: int, targets: list[str], **extra) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, **extra)
    get_peft_model(model, cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_ckpt, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a1": _make_adapter(tiny_ckpt, root / "a1", seed=1, r=4, targets=["q_proj", "v_proj"]),
        "a2": _make_adapter(tiny_ckpt, root / "a2", seed=2, r=8, targets=ALL, use_rslora=True),
        "a3": _make_adapter(tiny_ckpt, root / "a3", seed=3, r=2, targets=ALL),
        "big": _make_adapter(tiny_ckpt, root / "big", seed=4, r=16, targets=ALL),
        "dora": _make_adapter(tiny_ckpt, root / "dora", seed=5, r=4, targets=["q_proj"], use_dora=True),
    }


@pytest.fixture(scope="module")
def engine(tiny_ckpt, adapters):
    eng = LocalEngine(
        tiny_ckpt,
        max_running_requests=8,
        seed=0,
        lora_paths=[f"a1={adapters['a1']}", json.dumps({"lora_name": "a2", "lora_path": str(adapters["a2"])})],
        lora_target_modules=["all"],
        max_lora_rank=8,
    )
    yield eng
    asyncio.run(eng.close())


def _peft_logprobs(base: Path, adapter: Path | None, prompt: list[int], output: list[int]) -> list[float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + output])).logits[0].float(), -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def _lps(out: dict) -> list[float]:
    return [e[0] for e in out["meta_info"]["output_token_logprobs"]]


# ---------------------------------------------------------------- settings (no model)


def test_lora_paths_take_sglangs_three_forms():
    got = parse_lora_paths(["/a/b", "x=/c/d", json.dumps({"lora_name": "y", "lora_path": "/e", "pinned": True})])
    assert [(s.name, s.path, s.pinned) for s in got] == [
        ("/a/b", "/a/b", False),
        ("x", "/c/d", False),
        ("y", "/e", True),
    ]
    with pytest.raises(LoraError, match="given twice"):
        parse_lora_paths(["x=/a", "x=/b"])
    with pytest.raises(LoraError, match="unknown fields"):
        parse_lora_paths([json.dumps({"lora_name": "y", "lora_path": "/e", "scale": 2})])
    with pytest.raises(LoraError, match="not valid JSON"):
        parse_lora_paths(["{nope"])
    with pytest.raises(LoraError, match="names no adapter folder"):
        parse_lora_paths(["x="])


def test_target_modules_take_lists_all_and_refuse_unknown_names():
    assert parse_target_modules(["q_proj v_proj", "o_proj,k_proj"]) == {"q_proj", "v_proj", "o_proj", "k_proj"}
    assert parse_target_modules(["all"]) == set(ALL)
    assert parse_target_modules(None) is None
    with pytest.raises(LoraError, match=r"\['lm_head'\]"):
        parse_target_modules(["q_proj", "lm_head"])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"r": 0}, "r must be an integer in"),
        ({"r": 32}, r"--max-lora-rank"),
        ({"lora_alpha": -1}, "lora_alpha must be a positive number"),
        ({"use_dora": True}, "use_dora=True"),
        ({"bias": "all"}, "bias='all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
    ],
)
def test_adapter_configs_the_engine_would_serve_wrongly_are_refused_by_field(change, match):
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **change}
    with pytest.raises(LoraError, match=match):
        check_adapter_config(cfg, what="x", max_rank=16)
    plain = check_adapter_config({"r": 4, "lora_alpha": 8}, what="x", max_rank=None)
    assert plain.scale == 2.0
    assert check_adapter_config({"r": 4, "lora_alpha": 8, "use_rslora": True}, what="x", max_rank=None).scale == 4.0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((None, 0, None), "--max-loras-per-batch must lie in"),
        ((None, 4, 2), "--max-loaded-loras must be an integer >= --max-loras-per-batch"),
        ((0, 8, None), "--max-lora-rank must lie in"),
        ((True, 8, None), "--max-lora-rank must be an integer"),
    ],
)
def test_limits_out_of_bounds_are_refused_by_flag(args, match):
    with pytest.raises(LoraError, match=match):
        check_limits(*args)


# ---------------------------------------------------------------- the engine


def test_a_mixed_batch_gives_each_row_its_own_adapters_logprobs(engine, tiny_ckpt, adapters):
    names = [None, "a1", "a2", "a1", None, "a2"]
    before = engine.lora.mixed_forwards

    async def run():
        return await asyncio.gather(*[engine.generate(PROMPT, GREEDY, return_logprob=True, lora_path=n) for n in names])

    outs = asyncio.run(run())
    assert engine.lora.mixed_forwards > before  # the rows really shared forwards
    for name, out in zip(names, outs):
        ref = _peft_logprobs(tiny_ckpt, adapters[name] if name else None, PROMPT, out["output_ids"])
        assert max(abs(a - b) for a, b in zip(ref, _lps(out))) < 1e-5, name
    # the adapters change the model: three different continuations or scores
    assert len({tuple(round(x, 4) for x in _lps(o)) for o in outs}) == 3


def test_a_row_alone_equals_the_same_row_in_a_mixed_batch(engine):
    async def alone():
        return await engine.generate(PROMPT[:-3], GREEDY, return_logprob=True, lora_path="a2")

    async def mixed():
        outs = await asyncio.gather(
            *[engine.generate(PROMPT[:-3], GREEDY, return_logprob=True, lora_path=n) for n in ("a1", "a2", None)]
        )
        return outs[1]

    engine.flush_cache()
    one = asyncio.run(alone())
    engine.flush_cache()
    many = asyncio.run(mixed())
    assert one["output_ids"] == many["output_ids"]
    assert max(abs(a - b) for a, b in zip(_lps(one), _lps(many))) < 1e-5


def test_the_prefix_cache_never_shares_kv_across_adapters_or_loads(engine, adapters):
    prompt = list(range(40, 70))
    sp = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}

    async def gen(name):
        return (await engine.generate(prompt, sp, lora_path=name))["meta_info"]["cached_tokens"]

    async def run():
        first_a1 = await gen("a1")
        again_a1 = await gen("a1")
        first_a2 = await gen("a2")
        first_base = await gen(None)
        assert (await engine.unload_lora_adapter("a1"))["success"]
        assert (await engine.load_lora_adapter("a1", str(adapters["a1"])))["success"]
        reloaded = await gen("a1")
        return first_a1, again_a1, first_a2, first_base, reloaded

    engine.flush_cache()
    first_a1, again_a1, first_a2, first_base, reloaded = asyncio.run(run())
    assert first_a1 == 0 and again_a1 > 0  # the cache works within one adapter
    assert first_a2 == 0 and first_base == 0  # but another adapter, or none, never reads a1's KV
    assert reloaded == 0  # nor does a new load under the same name


def test_load_and_unload_follow_sglang(engine, adapters, tiny_ckpt):
    async def run():
        out = await engine.load_lora_adapter("a3", str(adapters["a3"]))
        assert out == {"success": True, "error_message": "", "loaded_adapters": engine.lora.listing()}
        assert out["loaded_adapters"]["a3"] == str(adapters["a3"])
        got = await engine.generate(PROMPT, GREEDY, return_logprob=True, lora_path="a3")
        ref = _peft_logprobs(tiny_ckpt, adapters["a3"], PROMPT, got["output_ids"])
        assert max(abs(a - b) for a, b in zip(ref, _lps(got))) < 1e-5
        again = await engine.load_lora_adapter("a3", str(adapters["a1"]))
        assert not again["success"] and "already loaded" in again["error_message"]
        gone = await engine.unload_lora_adapter("a3")
        assert gone["success"] and "a3" not in gone["loaded_adapters"]
        with pytest.raises(InvalidRequestError, match=r"lora_path: no adapter named 'a3' is loaded"):
            await engine.generate(PROMPT, GREEDY, lora_path="a3")
        missing = await engine.unload_lora_adapter("a3")
        assert not missing["success"] and "no adapter named 'a3'" in missing["error_message"]

    asyncio.run(run())


def test_adapters_the_engine_cannot_serve_are_refused_and_change_nothing(engine, adapters, tiny_ckpt, tmp_path):
    from agentrl.tiny import build_model

    other = build_model(tmp_path / "other", hidden_size=48)
    foreign = _make_adapter(other, tmp_path / "foreign", seed=0, r=4, targets=["q_proj"])
    loaded = engine.lora.listing()
    nan = tmp_path / "nan"
    shutil.copytree(adapters["a1"], nan)
    tensors = load_file(nan / "adapter_model.safetensors")
    first = sorted(tensors)[0]
    tensors[first][0, 0] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")

    async def refused(name, path):
        out = await engine.load_lora_adapter(name, str(path))
        assert not out["success"]
        assert out["loaded_adapters"] == loaded
        return out["error_message"]

    async def run():
        assert "r must be an integer in [1, 8] (--max-lora-rank)" in await refused("big", adapters["big"])
        assert "use_dora=True" in await refused("dora", adapters["dora"])
        msg = await refused("foreign", foreign)
        assert "trained on" in msg and "hidden_size=48" in msg
        assert "no PEFT adapter folder" in await refused("nothing", tmp_path)
        assert "no PEFT adapter folder" in await refused("fifo", "/dev/stdin")
        assert "holds NaN or infinite values" in await refused("nan", nan)

    asyncio.run(run())


def test_max_loras_per_batch_bounds_the_adapters_in_one_forward(tiny_ckpt, adapters):
    eng = LocalEngine(
        tiny_ckpt,
        max_running_requests=6,
        seed=0,
        lora_paths=[f"a1={adapters['a1']}", f"a3={adapters['a3']}"],
        lora_target_modules=["all"],
        max_loras_per_batch=2,
    )
    names = [None, "a1", "a3", None, "a1", "a3"]

    async def run():
        return await asyncio.gather(*[eng.generate(PROMPT, GREEDY, lora_path=n) for n in names])

    try:
        outs = asyncio.run(run())
    finally:
        asyncio.run(eng.close())
    assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outs)
    assert eng.lora.most_in_a_forward == 2 and eng.lora.mixed_forwards > 0


def test_adapters_outside_the_target_modules_and_bad_settings_are_refused(tiny_ckpt, adapters, tmp_path):
    narrow = LocalEngine(tiny_ckpt, max_running_requests=2, enable_lora=True, lora_target_modules=["q_proj", "v_proj"])
    try:
        out = asyncio.run(narrow.load_lora_adapter("a2", str(adapters["a2"])))
        assert not out["success"] and "--lora-target-modules q_proj v_proj" in out["error_message"]
        assert asyncio.run(narrow.load_lora_adapter("a1", str(adapters["a1"])))["success"]
    finally:
        asyncio.run(narrow.close())
    with pytest.raises(LoraError, match="--enable-torch-compile"):
        LocalEngine(tiny_ckpt, enable_lora=True, enable_torch_compile=True)
    with pytest.raises(LoraError, match="no PEFT adapter folder"):
        LocalEngine(tiny_ckpt, lora_paths=[f"x={tmp_path}"])


def test_an_engine_without_lora_refuses_lora_requests(tiny_ckpt):
    plain = LocalEngine(tiny_ckpt, max_running_requests=2)
    try:
        with pytest.raises(InvalidRequestError, match="lora_path: this engine was started without --enable-lora"):
            asyncio.run(plain.generate(PROMPT, GREEDY, lora_path="a1"))
        out = asyncio.run(plain.load_lora_adapter("a1", "/x"))
        assert not out["success"] and "--enable-lora" in out["error_message"]
    finally:
        asyncio.run(plain.close())


# ---------------------------------------------------------------- over HTTP


def test_sglangs_lora_endpoints_and_fields_over_http(engine, adapters, tiny_ckpt):
    with serve_app(build_app(engine, model_name="tiny")) as url, httpx.Client(base_url=url, timeout=60) as http:
        info = http.get("/get_server_info").json()
        assert (
            info["enable_lora"] and info["max_lora_rank"] == 8 and "a2" in {p["lora_name"] for p in info["lora_paths"]}
        )
        r = http.post("/load_lora_adapter", json={"lora_name": "h3", "lora_path": str(adapters["a3"])})
        assert r.status_code == 200 and r.json()["loaded_adapters"]["h3"] == str(adapters["a3"])
        models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert models["h3"]["parent"] == "tiny" and models["h3"]["root"] == str(adapters["a3"])
        # one batch, one adapter per row (SGLang's list form), None for the base model
        batch = http.post(
            "/generate",
            json={
                "input_ids": [PROMPT] * 3,
                "sampling_params": GREEDY,
                "lora_path": ["h3", None, "a1"],
                "return_logprob": True,
            },
        ).json()
        for out, path in zip(batch, [adapters["a3"], None, adapters["a1"]]):
            ref = _peft_logprobs(tiny_ckpt, path, PROMPT, out["output_ids"])
            assert max(abs(a - b) for a, b in zip(ref, _lps(out))) < 1e-5
        # OpenAI: SGLang's model "base:adapter" runs the adapter
        comp = http.post(
            "/v1/completions",
            json={"model": "tiny:h3", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True},
        ).json()
        assert comp["choices"][0]["text"] == batch[0]["text"]
        # refusals name the field
        r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "lora_path": "nope"})
        assert r.status_code == 400 and "lora_path: no adapter named 'nope'" in r.text
        r = http.post("/v1/completions", json={"model": "tiny:nope", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 400 and "model: no adapter named 'nope'" in r.text
        r = http.post("/generate", json={"input_ids": [PROMPT] * 2, "lora_path": ["h3"]})
        assert r.status_code == 400 and "lora_path has 1 entries for 2 inputs" in r.text
        r = http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters["a1"]), "scale": 2})
        assert r.status_code == 400 and "scale" in r.text
        r = http.post("/unload_lora_adapter", json={"lora_name": "h3"})
        assert r.status_code == 200 and "h3" not in r.json()["loaded_adapters"]
        r = http.post("/unload_lora_adapter", json={"lora_name": "h3"})
        assert r.status_code == 400 and "no adapter named 'h3'" in r.json()["error_message"]
        # SGLang's /update_weight_version: what responses report from now on (the adapter load set none)
        r = http.post("/update_weight_version", json={"new_version": "7", "abort_all_requests": False})
        assert r.status_code == 200 and r.json()["success"]
        assert http.get("/get_weight_version").json()["weight_version"] == "7"
        out = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "lora_path": "a1"}).json()
        assert out["meta_info"]["weight_version"] == "7"
        for bad, field in (
            ({"new_version": 7}, "new_version"),
            ({"new_version": "8", "x": 1}, "unknown field 'x'"),
            ({}, "new_version"),
        ):
            r = http.post("/update_weight_version", json=bad)
            assert r.status_code == 400 and field in r.text, bad
        assert http.get("/get_weight_version").json()["weight_version"] == "7"


@pytest.mark.e2e
def test_agentrl_serve_takes_sglangs_lora_flags(tiny_ckpt, adapters, tmp_path):
    from agentrl.engines.local.process import local_server

    flags = ["--lora-paths", f"a1={adapters['a1']}", "--max-loras-per-batch", "2", "--max-lora-rank", "8"]
    flags += ["--lora-target-modules", "q_proj", "v_proj"]
    with local_server(tiny_ckpt, log_path=tmp_path / "engine.log", extra_args=flags, startup_timeout=120) as url:
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()
        assert info["enable_lora"] and info["max_loras_per_batch"] == 2 and info["max_lora_rank"] == 8
        assert info["lora_target_modules"] == ["q_proj", "v_proj"]
        out = httpx.post(
            f"{url}/generate",
            json={"input_ids": PROMPT, "sampling_params": GREEDY, "lora_path": "a1", "return_logprob": True},
            timeout=60,
        ).json()
    ref = _peft_logprobs(tiny_ckpt, adapters["a1"], PROMPT, out["output_ids"])
    assert max(abs(a - b) for a, b in zip(ref, _lps(out))) < 1e-5


# ---------------------------------------------------------------- loads and unloads meeting requests


def test_a_later_adapter_of_a_higher_rank_grows_the_stacks_and_mixes_exactly(tiny_ckpt, adapters):
    eng = LocalEngine(tiny_ckpt, max_running_requests=4, enable_lora=True)  # no --max-lora-rank: any rank

    async def run():
        assert (await eng.load_lora_adapter("small", str(adapters["a3"])))["success"]  # r 2
        assert (await eng.load_lora_adapter("wide", str(adapters["a2"])))["success"]  # r 8: the stacks grow
        names = ["small", "wide", None]
        return names, await asyncio.gather(
            *[eng.generate(PROMPT, GREEDY, return_logprob=True, lora_path=n) for n in names]
        )

    try:
        names, outs = asyncio.run(run())
    finally:
        asyncio.run(eng.close())
    assert eng.lora.mixed_forwards > 0
    for name, out in zip(names, outs):
        path = {"small": adapters["a3"], "wide": adapters["a2"], None: None}[name]
        ref = _peft_logprobs(tiny_ckpt, path, PROMPT, out["output_ids"])
        assert max(abs(a - b) for a, b in zip(ref, _lps(out))) < 1e-5, name


def test_max_loaded_loras_holds_against_concurrent_loads(tiny_ckpt, adapters):
    eng = LocalEngine(tiny_ckpt, max_running_requests=2, enable_lora=True, max_loras_per_batch=1, max_loaded_loras=1)

    async def run():
        return await asyncio.gather(*[eng.load_lora_adapter(f"x{i}", str(adapters["a1"])) for i in range(3)])

    try:
        outs = asyncio.run(run())
    finally:
        asyncio.run(eng.close())
    assert sum(o["success"] for o in outs) == 1
    assert all("--max-loaded-loras 1" in o["error_message"] for o in outs if not o["success"])
    assert len(eng.lora.by_name) == 1 == sum(1 for a in eng.lora.slots if a is not None)


def test_an_unload_waits_for_the_requests_using_the_adapter(tiny_ckpt, adapters):
    eng = LocalEngine(tiny_ckpt, max_running_requests=2, lora_paths=[f"a1={adapters['a1']}"])
    order: list[str] = []

    async def run():
        async def long():
            out = await eng.generate(PROMPT, {**GREEDY, "max_new_tokens": 150}, lora_path="a1")
            order.append("generated")
            return out

        task = asyncio.ensure_future(long())
        while eng.num_running == 0:
            await asyncio.sleep(0.005)
        out = await eng.unload_lora_adapter("a1")
        order.append("unloaded")
        with pytest.raises(InvalidRequestError, match="no adapter named 'a1'"):
            await eng.generate(PROMPT, GREEDY, lora_path="a1")
        return out, await task

    try:
        unloaded, generated = asyncio.run(run())
    finally:
        asyncio.run(eng.close())
    assert unloaded["success"] and order == ["generated", "unloaded"]
    assert len(generated["output_ids"]) == 150  # it ran to the end on its adapter
    assert all(a is None for a in eng.lora.slots)


def test_a_cancelled_load_loses_no_slot_and_a_closed_engine_answers(tiny_ckpt, adapters):
    eng = LocalEngine(tiny_ckpt, max_running_requests=2, enable_lora=True)

    async def run():
        for delay in (0.0, 0.01, 0.05):
            task = asyncio.ensure_future(eng.load_lora_adapter(f"c{delay}", str(adapters["a2"])))
            await asyncio.sleep(delay)
            task.cancel()
        await asyncio.sleep(1.0)  # whatever was queued is installed (and registered) meanwhile
        slotted = {a.name for a in eng.lora.slots if a is not None}
        assert slotted == set(eng.lora.by_name)
        await eng.close()
        return await asyncio.wait_for(eng.load_lora_adapter("late", str(adapters["a1"])), 10)

    late = asyncio.run(run())
    assert not late["success"] and "engine closed" in late["error_message"]


def test_the_prefix_store_tags_entries_with_the_adapter_load(engine, adapters):
    async def run():
        engine.flush_cache()
        await engine.generate(list(range(90, 110)), {"max_new_tokens": 2, "ignore_eos": True}, lora_path="a2")
        return engine.lora.by_name["a2"].uid

    uid = asyncio.run(run())
    assert {e.tag for e in engine.store._entries.values()} == {uid}


def test_a_base_weight_update_keeps_the_adapters_on_the_new_base(tiny_ckpt, adapters, tmp_path):
    from transformers import AutoModelForCausalLM

    new_base = tmp_path / "base2"
    shutil.copytree(tiny_ckpt, new_base)
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt)
    torch.manual_seed(9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(new_base)
    eng = LocalEngine(tiny_ckpt, max_running_requests=2, lora_paths=[f"a1={adapters['a1']}"])

    async def run():
        assert (await eng.update_weights_from_disk(str(new_base)))["success"]
        return await eng.generate(PROMPT, GREEDY, return_logprob=True, lora_path="a1")

    try:
        out = asyncio.run(run())
    finally:
        asyncio.run(eng.close())
    ref = _peft_logprobs(new_base, adapters["a1"], PROMPT, out["output_ids"])
    assert max(abs(a - b) for a, b in zip(ref, _lps(out))) < 1e-5


def test_prompt_logprobs_streams_and_chat_run_under_the_adapter(engine, adapters, tiny_ckpt):
    async def scored():
        return await engine.generate(
            PROMPT, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0, lora_path="a2"
        )

    out = asyncio.run(scored())
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ref_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_ckpt), adapters["a2"])
    with torch.no_grad():
        logp = torch.log_softmax(ref_model(torch.tensor([PROMPT])).logits[0].float(), -1)
    want = [logp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    got = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
    assert max(abs(a - b) for a, b in zip(want, got)) < 1e-5
    with serve_app(build_app(engine, model_name="tiny")) as url, httpx.Client(base_url=url, timeout=60) as http:
        # a batch with one adapter name for every row; a stream on an adapter; chat with model "base:adapter"
        body = {"input_ids": [PROMPT, PROMPT[:-2]], "sampling_params": GREEDY, "return_logprob": True}
        batch = http.post("/generate", json={**body, "lora_path": "a1"}).json()
        rows = http.post("/generate", json={**body, "lora_path": ["a1", "a1"]}).json()
        assert [b["output_ids"] for b in batch] == [r["output_ids"] for r in rows]
        with http.stream(
            "POST",
            "/generate",
            json={"input_ids": PROMPT, "sampling_params": GREEDY, "stream": True, "lora_path": "a1"},
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["output_ids"] == batch[0]["output_ids"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0, "logprobs": True}
        by_model = http.post("/v1/chat/completions", json={**chat, "model": "tiny:a1"}).json()
        by_field = http.post("/v1/chat/completions", json={**chat, "lora_path": "a1"}).json()
        base = http.post("/v1/chat/completions", json=chat).json()

        def lps(reply):
            return [e["logprob"] for e in reply["choices"][0]["logprobs"]["content"]]

        assert lps(by_model) == lps(by_field) and lps(by_model) != lps(base)


def test_a_runs_policy_adapter_is_replaced_in_place_and_serves_requests_naming_none(tiny_ckpt, adapters):
    """The adapter-only weight sync of a LoRA run (``EngineServer.load_policy_adapter``): each version replaces the
    last under one name; requests naming no adapter run under it and report its version; a request running on the
    old one finishes on it, its slot freed after."""
    from safetensors.torch import load_file as read

    eng = LocalEngine(tiny_ckpt, max_running_requests=4, enable_lora=True, max_lora_rank=8)
    cfg = json.loads((adapters["a1"] / "adapter_config.json").read_text())
    v1 = read(adapters["a1"] / "adapter_model.safetensors")
    cfg3 = json.loads((adapters["a3"] / "adapter_config.json").read_text())
    v2 = read(adapters["a3"] / "adapter_model.safetensors")

    async def push(tensors, config, version):
        return await eng.load_lora_adapter(
            "policy", tensors=tensors, config=config, replace=True, weight_version=version, serve_by_default=True
        )

    async def run():
        base = await eng.generate(PROMPT, GREEDY, return_logprob=True)
        assert base["meta_info"]["weight_version"] == "default"
        assert (await push(v1, cfg, "1"))["success"]
        long = asyncio.ensure_future(eng.generate(PROMPT, {**GREEDY, "max_new_tokens": 120}, return_logprob=True))
        while eng.num_running == 0:
            await asyncio.sleep(0.005)
        assert (await push(v2, cfg3, "2"))["success"]
        new = await eng.generate(PROMPT, GREEDY, return_logprob=True)
        return base, await long, new

    try:
        base, old, new = asyncio.run(run())
        time.sleep(0.2)
    finally:
        asyncio.run(eng.close())
    assert old["meta_info"]["weight_version"] == "1" and new["meta_info"]["weight_version"] == "2"
    ref_old = _peft_logprobs(tiny_ckpt, adapters["a1"], PROMPT, old["output_ids"])
    ref_new = _peft_logprobs(tiny_ckpt, adapters["a3"], PROMPT, new["output_ids"])
    assert max(abs(a - b) for a, b in zip(ref_old, _lps(old))) < 1e-5  # all 120 tokens on version 1
    assert max(abs(a - b) for a, b in zip(ref_new, _lps(new))) < 1e-5
    assert _lps(base) != _lps(new)[: len(_lps(base))]
    assert [a.name for a in eng.lora.slots if a is not None] == ["policy"]  # version 1's slot was freed
    assert eng.lora.by_name["policy"].version == "2"
