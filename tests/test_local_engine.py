"""The embedded engine against ground truth: a plain full-sequence forward of the same checkpoint.

Every log-prob the engine returns must equal ``log_softmax(model(prompt + output).logits / T)`` at
the sampled token (greedy: T = 1) within 1e-4, whatever the batching, queueing, chunked prefill or
prefix-cache reuse did on the way.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from agentrl.engines.local import InvalidRequestError, LocalEngine


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    from agentrl.tiny import build_model

    return build_model(tmp_path_factory.mktemp("local_engine") / "tiny", mean_turn_tokens=10.0)


@pytest.fixture(scope="session")
def ref_model(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def make_engine(ckpt, **kw) -> LocalEngine:
    # Few rows and a small prefill chunk so queueing, row compaction and chunking all happen.
    kw = {"max_running_requests": 4, "max_cached_sequences": 16, "chunked_prefill_size": 48, "seed": 0, **kw}
    return LocalEngine(ckpt, **kw)


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = make_engine(ckpt)
    yield eng
    asyncio.run(eng.close())


def rescore(model, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """Log-probs of ``output`` given ``prompt`` from one plain forward over the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    t = temperature if temperature >= 1e-6 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


def assert_exact(model, prompt, out, temperature):
    meta = out["meta_info"]
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert meta["completion_tokens"] == len(out["output_ids"]) > 0
    ref = rescore(model, prompt, out["output_ids"], temperature)
    assert max(abs(a - b) for (a, _, _), b in zip(lps, ref)) < 1e-4


def prompts(n: int, base: int = 3) -> list[list[int]]:
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # a common "system prompt" prefix
    return [shared + [(base * i + j) % 300 + 3 for j in range(2 + 9 * i)] for i in range(n)]


async def test_logprobs_equal_full_rescore_under_concurrency(engine, ref_model):
    ps = prompts(12)
    temps = [1.0, 0.7, 0.0] * 4
    params = [
        {
            "temperature": t,
            "max_new_tokens": 5 + 7 * (i % 5),
            "ignore_eos": i % 2 == 0,
            "top_p": 0.9 if i % 3 == 1 else 1.0,
            "top_k": 20 if i % 4 == 3 else -1,
        }
        for i, t in enumerate(temps)
    ]
    outs = await asyncio.gather(*(engine.generate(p, sp, return_logprob=True) for p, sp in zip(ps, params)))
    for p, sp, out in zip(ps, params, outs):
        assert_exact(ref_model, p, out, sp["temperature"])
        fr = out["meta_info"]["finish_reason"]
        n = len(out["output_ids"])
        if sp["ignore_eos"]:
            assert fr == {"type": "length", "length": sp["max_new_tokens"]} and n == sp["max_new_tokens"]
        else:
            assert fr["type"] in ("length", "stop") and n <= sp["max_new_tokens"]
        assert out["meta_info"]["prompt_tokens"] == len(p)
    assert any(o["meta_info"]["cached_tokens"] > 0 for o in outs)  # the shared prefix was reused

    # Next turn of each conversation: the whole history is re-sent and hits the prefix cache.
    turn2 = [p + o["output_ids"] + [20, 21, 22] for p, o in zip(ps[:6], outs[:6])]
    outs2 = await asyncio.gather(
        *(engine.generate(p, {"temperature": 0.7, "max_new_tokens": 6}, return_logprob=True) for p in turn2)
    )
    for p, prev, out in zip(ps, outs, outs2):
        assert_exact(ref_model, turn2[ps.index(p)], out, 0.7)
        assert out["meta_info"]["cached_tokens"] >= len(p) + len(prev["output_ids"]) - 1


async def test_long_prompt_grows_cache_and_chunks(engine, ref_model):
    p = [(i * 7) % 390 + 3 for i in range(400)]  # > initial capacity 256, > 8 prefill chunks
    out = await engine.generate(p, {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}, return_logprob=True)
    assert_exact(ref_model, p, out, 1.0)


async def test_prefix_cache_gives_same_greedy_outputs_as_no_cache(ckpt, engine):
    plain = make_engine(ckpt, max_cached_sequences=0)
    try:
        sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
        p1 = [5, 6, 7, 8, 9, 40, 41, 42]
        a1, b1 = [await e.generate(p1, sp, return_logprob=True) for e in (engine, plain)]
        p2 = p1 + a1["output_ids"] + [50, 51]
        a2, b2 = [await e.generate(p2, sp, return_logprob=True) for e in (engine, plain)]
        assert a1["output_ids"] == b1["output_ids"] and a2["output_ids"] == b2["output_ids"]
        for x, y in ((a1, b1), (a2, b2)):
            lx, ly = x["meta_info"]["output_token_logprobs"], y["meta_info"]["output_token_logprobs"]
            assert max(abs(u[0] - v[0]) for u, v in zip(lx, ly)) < 1e-5
        assert a2["meta_info"]["cached_tokens"] >= len(p1) + 11 and b2["meta_info"]["cached_tokens"] == 0
        engine.flush_cache()
        a3 = await engine.generate(p2, sp)
        assert a3["meta_info"]["cached_tokens"] == 0 and a3["output_ids"] == a2["output_ids"]
    finally:
        await plain.close()


async def test_finish_reasons_and_trimming(ckpt, engine):
    tok = engine.tokenizer
    p = [5, 6, 7, 8, 9]

    async def sample(**extra):  # a fresh engine with the same seed samples the same tokens
        eng = make_engine(ckpt, seed=1234)
        try:
            return await eng.generate(p, {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, **extra})
        finally:
            await eng.close()

    base = await sample()
    ids = base["output_ids"]
    assert base["meta_info"]["finish_reason"] == {"type": "length", "length": 10} and len(ids) == 10
    assert base["text"] == tok.decode(ids, skip_special_tokens=True)

    stop_id = ids[4]
    first = ids.index(stop_id)
    out = await sample(stop_token_ids=[stop_id], ignore_eos=False)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == ids[: first + 1]  # the stop token is returned
    assert out["text"] == tok.decode(ids[:first], skip_special_tokens=True)  # ... and trimmed from the text
    untrimmed = await sample(stop_token_ids=[stop_id], ignore_eos=False, no_stop_trim=True)
    assert untrimmed["text"] == tok.decode(ids[: first + 1], skip_special_tokens=True)

    full = tok.decode(ids)
    stop = tok.decode(ids[5:7])
    out = await sample(stop=[stop])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    n = len(out["output_ids"])
    assert n <= 7 and out["output_ids"] == ids[:n] and stop in tok.decode(ids[:n])
    assert out["text"] == tok.decode(ids[:n], skip_special_tokens=True).split(stop)[0]
    out = await sample(stop=stop, no_stop_trim=True)
    assert out["text"] == tok.decode(ids[: len(out["output_ids"])], skip_special_tokens=True)
    assert full.startswith(tok.decode(out["output_ids"]))

    # EOS (the tiny model ends turns after ~10 tokens): returned, matched, not in the text.
    eos = tok.eos_token_id
    outs = await asyncio.gather(*(engine.generate([5, 6, i + 10], {"max_new_tokens": 200}) for i in range(6)))
    stopped = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert stopped
    for o in stopped:
        assert o["meta_info"]["finish_reason"]["matched"] == eos and o["output_ids"][-1] == eos
        assert o["text"] == tok.decode(o["output_ids"][:-1], skip_special_tokens=True)


async def test_context_length_clamps_and_rejects(ckpt):
    eng = make_engine(ckpt, context_length=32)
    try:
        out = await eng.generate(list(range(3, 28)), {"max_new_tokens": 100, "ignore_eos": True})
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 7} and len(out["output_ids"]) == 7
        with pytest.raises(InvalidRequestError, match="context length"):
            await eng.generate(list(range(3, 35)), {})
    finally:
        await eng.close()


@pytest.mark.parametrize(
    "ids, sp, match",
    [
        ([], {}, "non-empty"),
        ([1, 2, 10**6], {}, "lie in"),
        ([1, 2], {"top_p": 0}, "top_p"),
        ([1, 2], {"max_new_tokens": -1}, "max_new_tokens"),
        ([1, 2], {"top_k": 0}, "top_k"),
        ([1, 2], {"temperature": -0.5}, "temperature"),
        ([1, 2], {"frequency_penalty": 0.5}, "not supported"),
        ([1, 2], {"tempreature": 1.0}, "unknown"),
        ([1, 2], {"stop": [""]}, "stop"),
        # each of these used to kill the worker loop for every request (issue 18), or answer 500
        ([1, 2], {"skip_special_tokens": "no"}, "sampling_params.skip_special_tokens"),
        ([1, 2], {"top_k": 2**63}, "sampling_params.top_k"),
        ([1, 2], {"temperature": 10**400}, "sampling_params.temperature"),
        ([1, 2], {"temperature": float("inf")}, "sampling_params.temperature"),
        ([1, 2], {"stop": 5}, "sampling_params.stop"),
        ([1, 2], {"stop_token_ids": 5}, "sampling_params.stop_token_ids"),
        ([1, 2], {"stop_token_ids": [-5]}, "sampling_params.stop_token_ids"),
        ([1, 2], {"sampling_seed": 2**64}, "sampling_params.sampling_seed"),
        ([1, 2], {"max_new_tokens": True}, "sampling_params.max_new_tokens"),
        ([1, 2], {"stop": ["x" * 600]}, "sampling_params.stop"),
    ],
)
async def test_bad_requests_are_refused(engine, ids, sp, match):
    with pytest.raises(InvalidRequestError, match=match):
        await engine.generate(ids, sp)
    out = await engine.generate([5, 6, 7], {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True})
    assert len(out["output_ids"]) == 3 and engine.alive  # and the engine serves on


async def test_abort_running_queued_and_all(engine):
    sp = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 1.0}
    tasks = [asyncio.create_task(engine.generate([5, 6, 7 + i], sp, rid=f"long-{i}")) for i in range(6)]
    await asyncio.sleep(0.3)
    engine.abort("long-0")  # running
    engine.abort("long-5")  # still queued behind the 4 rows
    first, last = await asyncio.wait_for(asyncio.gather(tasks[0], tasks[5]), 20)
    for out in (first, last):
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) < 3000
    engine.abort(abort_all=True)
    rest = await asyncio.wait_for(asyncio.gather(*tasks[1:5]), 20)
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in rest)
    assert engine.num_running == 0


async def test_weight_update_from_disk(ckpt, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    eng = make_engine(ckpt)
    try:
        sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
        p = [5, 6, 7, 8]
        before = await eng.generate(p, sp)
        assert before["meta_info"]["weight_version"] == eng.weight_version == "default"

        bad = await eng.update_weights_from_disk(str(tmp_path / "missing"))
        assert bad["success"] is False and "safetensors" in bad["message"]
        small = tmp_path / "small"
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=400,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        ).save_pretrained(small)
        bad = await eng.update_weights_from_disk(str(small))
        assert bad["success"] is False and "does not match" in bad["message"]
        assert (await eng.generate(p, sp))["output_ids"] == before["output_ids"]  # unchanged

        model = AutoModelForCausalLM.from_pretrained(ckpt)
        with torch.no_grad():
            model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
        new = tmp_path / "new"
        model.save_pretrained(new)
        ok = await eng.update_weights_from_disk(str(new), weight_version="step-1")
        assert ok["success"] is True, ok
        after = await eng.generate(p, sp, return_logprob=True)
        assert after["output_ids"] != before["output_ids"]
        assert after["meta_info"]["weight_version"] == "step-1" and after["meta_info"]["cached_tokens"] == 0
        assert_exact(model.eval(), p, after, 0.0)
        shutil.copy(ckpt / "model.safetensors", new / "model.safetensors")
        assert (await eng.update_weights_from_disk(str(new)))["success"]
        assert eng.weight_version == "2"
        assert (await eng.generate(p, sp))["output_ids"] == before["output_ids"]
    finally:
        await eng.close()


async def test_sampling_seed_replays_the_same_tokens_whatever_the_batch(engine, ref_model):
    """A request with ``sampling_seed`` draws from its own RNG: same tokens alone or among other requests."""
    p = prompts(3)[2]
    sp = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 1234}
    alone = await engine.generate(p, dict(sp), return_logprob=True)
    noise = [engine.generate(q, {"temperature": 1.0, "max_new_tokens": 12}) for q in prompts(6, base=5)]
    crowded, *_ = await asyncio.gather(engine.generate(p, dict(sp), return_logprob=True), *noise)
    other_seed = await engine.generate(p, {**sp, "sampling_seed": 99})
    assert alone["output_ids"] == crowded["output_ids"]
    assert other_seed["output_ids"] != alone["output_ids"]
    assert_exact(ref_model, p, crowded, 1.0)
    with pytest.raises(InvalidRequestError, match="sampling_seed"):
        await engine.generate(p, {**sp, "sampling_seed": "x"})


# ---------------------------------------------------------------- faults stay inside their request


GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


async def test_a_fault_in_one_request_fails_only_that_request(ckpt, monkeypatch):
    """A sampling fault pinned on one row (even ``SystemExit``) fails that request; its batch mates finish."""
    from agentrl.engines.local import EngineFault
    from agentrl.engines.local import engine as engine_mod

    real = engine_mod.sample_batch

    def faulty(logits, params, gens):
        if any(p.top_p == 0.123 for p in params):
            raise SystemExit(3)
        return real(logits, params, gens)

    eng = make_engine(ckpt)
    try:
        prompts_ = [[5, 6, 7 + i] for i in range(3)]
        alone = [(await eng.generate(p, GREEDY))["output_ids"] for p in prompts_]
        monkeypatch.setattr(engine_mod, "sample_batch", faulty)
        poison = eng.generate([9, 9, 9], {"temperature": 1.0, "top_p": 0.123, "max_new_tokens": 6})
        outs = await asyncio.wait_for(
            asyncio.gather(poison, *(eng.generate(p, GREEDY) for p in prompts_), return_exceptions=True), 30
        )
        assert isinstance(outs[0], EngineFault) and "SystemExit" in str(outs[0])
        assert [o["output_ids"] for o in outs[1:]] == alone
        assert eng.alive and eng.restarts == 0 and eng.num_running == 0
    finally:
        await eng.close()


async def test_a_fault_in_a_batch_fails_its_requests_and_the_loop_goes_on(ckpt):
    """A forward that raises fails the requests holding rows; waiting ones and later ones are served."""
    from agentrl.engines.local import EngineFault

    eng = make_engine(ckpt, max_running_requests=2)
    try:
        before = (await eng.generate([5, 6, 7], GREEDY))["output_ids"]
        real, calls = eng.runner.forward, []

        def forward(*a, **k):
            calls.append(1)
            if len(calls) == 3:  # a decode step of the first two requests
                raise KeyboardInterrupt("injected")
            return real(*a, **k)

        eng.runner.forward = forward
        outs = await asyncio.wait_for(
            asyncio.gather(*(eng.generate([5, 6, 7], GREEDY) for _ in range(4)), return_exceptions=True), 30
        )
        failed = [o for o in outs if isinstance(o, BaseException)]
        assert len(failed) == 2 and all(isinstance(o, EngineFault) for o in failed), outs
        assert [o["output_ids"] for o in outs if not isinstance(o, BaseException)] == [before, before]
        assert eng.alive and eng.restarts == 1 and isinstance(eng.last_error, KeyboardInterrupt)
        assert (await eng.generate([5, 6, 7], GREEDY))["output_ids"] == before

        def broken(*a, **k):  # a sticky fault (a broken device): every iteration fails
            raise RuntimeError("device lost")

        eng.runner.forward = broken
        for _ in range(3):
            with pytest.raises(EngineFault, match="device lost"):
                await asyncio.wait_for(eng.generate([5, 6, 7], GREEDY), 30)
        assert not eng.alive  # /health answers 503: a supervisor restarts the server
        eng.runner.forward = real
        assert (await eng.generate([5, 6, 7], GREEDY))["output_ids"] == before
        assert eng.alive  # one good iteration and it is healthy again
    finally:
        await eng.close()
    assert not eng.alive


@pytest.mark.parametrize("bad", ["meta", "nan", "one_nan", "one_inf", "int", "list"])
async def test_weight_updates_are_checked_before_the_swap(ckpt, bad):
    """A tensor the copy would fail on (meta device) or that would serve garbage is refused; nothing changes."""
    eng = make_engine(ckpt)
    try:
        before = (await eng.generate([5, 6, 7], GREEDY))["output_ids"]
        tensors = {k: v.clone() for k, v in eng.model.state_dict().items()}
        names = list(tensors)
        first, last = names[0], names[-1]
        tensors[first] = tensors[first] + 1.0  # a valid change that must not land either
        shape = tensors[last].shape
        tensors[last] = {
            "meta": torch.empty(shape, device="meta"),
            "nan": torch.full(shape, float("nan")),
            "one_nan": tensors[last].flatten().index_fill(0, torch.tensor([7]), float("nan")).reshape(shape),
            "one_inf": tensors[last].flatten().index_fill(0, torch.tensor([3]), -float("inf")).reshape(shape),
            "int": torch.zeros(shape, dtype=torch.int64),
            "list": [[0.0]],
        }[bad]
        out = await eng.update_weights_from_tensors(tensors, weight_version="bad")
        assert out["success"] is False and (last in out["message"] or "bad tensors" in out["message"]), out
        assert eng.weight_version == "default"
        assert (await eng.generate([5, 6, 7], GREEDY))["output_ids"] == before
        assert eng.alive
    finally:
        await eng.close()
