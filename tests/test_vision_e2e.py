"""Vision-language episodes end to end: ``agentrl serve`` running the tiny VLM over HTTP (SGLang's
``/generate`` with ``image_data``, the OpenAI chat endpoint with image parts), the episode loop with two
pictures per episode, the trainer re-scoring what the engine sampled, and ``agentrl train`` on the Shapes env."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from PIL import Image as PILImage

import agentrl
from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig, TrainConfig
from agentrl.engines.http import SGLangEngine
from agentrl.envs.shapes import Shapes, count_regions
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.trainer.base import TrainSample
from agentrl.trainer.torch_trainer import TorchTrainer
from agentrl.types import Sample, Status
from agentrl.vlm import vision_for
from tests.conftest import run_cli

pytestmark = pytest.mark.e2e


def _ctx(url, tiny_vlm, **cfg) -> EpisodeContext:
    from transformers import AutoTokenizer

    template = ChatTemplate(AutoTokenizer.from_pretrained(tiny_vlm), vision=vision_for(tiny_vlm))
    # 200 tokens: the tiny VLM ends a turn after ~10 (P(a length finish) ~ 0.9**200), so no test sees one
    config = RolloutConfig(**{"rollout_max_turn_len": 200, "max_turns": 4, **cfg})
    return EpisodeContext(engine=SGLangEngine(url), template=template, config=config)


def _train_samples(samples: list[Sample]) -> list[TrainSample]:
    return [
        TrainSample(
            tokens=list(s.tokens),
            response_length=s.response_length,
            loss_mask=list(s.loss_mask),
            rollout_log_probs=list(s.rollout_log_probs),
            advantages=[1.0 if i % 2 else -1.0] * s.response_length,
            multimodal_inputs=s.multimodal_inputs,
            multimodal_train_inputs=s.multimodal_train_inputs,
        )
        for i, s in enumerate(samples)
    ]


async def test_two_picture_episodes_are_token_exact_and_train(tiny_vlm_server, tiny_vlm):
    ctx = _ctx(tiny_vlm_server, tiny_vlm, n_samples_per_prompt=2, rollout_temperature=1.0)
    samples, summary = await generate_rollout(ctx, Shapes, Shapes.tasks(3, seed=1))
    await ctx.engine.close()
    vision = ctx.template.vision
    assert summary.samples == 6
    for s in samples:
        s.validate()
        assert s.status == Status.COMPLETED, s.metadata
        assert len(s.turn_spans) == 2 and len(s.multimodal_inputs["images"]) == 2
        want = [int(c) for c in s.label.split(",")]
        assert [count_regions(u) for u in s.multimodal_inputs["images"]] == want  # the env's pictures, in order
        assert [len(v) for v in s.multimodal_train_inputs.values()] == [2, 2]
        # every placeholder is written by the processor (mask 0), 4 per picture: one in the prompt, one in a delta
        prompt_ph = s.tokens[: s.prompt_length].count(vision.image_token_id)
        resp = s.tokens[s.prompt_length :]
        resp_ph = [j for j, t in enumerate(resp) if t == vision.image_token_id]
        assert prompt_ph == 4 and len(resp_ph) == 4 and all(s.loss_mask[j] == 0 for j in resp_ph)
        assert not any(t == vision.image_token_id for a, b in s.turn_spans for t in resp[a:b])
    # the trainer (packed rows, features merged at the placeholders) re-scores the engine's log-probs
    batch = _train_samples(samples)
    trainer = TorchTrainer(tiny_vlm, TrainConfig(lr=1e-2, global_batch_size=len(batch), seed=0))
    old = trainer.compute_log_probs(batch, ref=False).old
    for s, lp in zip(batch, old):
        m = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert (torch.tensor(lp)[m] - torch.tensor(s.rollout_log_probs)[m]).abs().max() < 1e-4
    # a dump round-trips: the pictures kept, processed again by the trainer into the same log-probs
    back = [Sample.from_dict(json.loads(s.to_json())) for s in samples]
    assert all(
        b.multimodal_train_inputs is None and b.multimodal_inputs == s.multimodal_inputs for b, s in zip(back, samples)
    )
    assert trainer.compute_log_probs(_train_samples(back), ref=False).old == old
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train_step(batch)
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


class BadPictures(agentrl.Env):
    """Task ``kind`` decides the second observation: a good picture, an undecodable one, or one too large."""

    async def reset(self, *, seed=None, options=None):
        self.kind = options["kind"]
        img = PILImage.new("RGB", (20, 20), (9, 9, 200))
        return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "go"}]}], {}

    async def step(self, action):
        if self.kind == "good":
            part = {"type": "image", "image": PILImage.new("RGB", (30, 10), (200, 9, 9))}
        elif self.kind == "broken":
            part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAA="}}
        else:
            part = {"type": "image", "image": PILImage.new("L", (4100, 4100))}
        return [{"role": "user", "content": [part]}], 0.5, False, False, {}


async def test_a_bad_picture_fails_only_its_sample_with_the_reason(tiny_vlm_server, tiny_vlm):
    ctx = _ctx(tiny_vlm_server, tiny_vlm, max_turns=2)
    tasks = [{"prompt": k, "kind": k} for k in ("good", "broken", "huge")]
    samples, _ = await generate_rollout(ctx, BadPictures, tasks)
    await ctx.engine.close()
    by = {s.metadata["task"]["kind"]: s for s in samples}
    assert by["good"].status == Status.TRUNCATED and len(by["good"].multimodal_inputs["images"]) == 2
    for kind, words in (("broken", "not a decodable image"), ("huge", "4100x4100 pixels is over")):
        s = by[kind]
        assert s.status == Status.FAILED and s.status_reason == "image", s.metadata
        assert words in s.metadata["error"]
        assert len(s.turn_spans) == 1 and len(s.multimodal_inputs["images"]) == 1  # the first turn is kept


async def test_the_served_endpoints_take_pictures(tiny_vlm_server, tiny_vlm):
    """``/v1/chat/completions`` with image parts (and tools), ``/generate`` with ``image_data`` for a text prompt,
    a batch and a stream: each prompt holds exactly the processor's placeholders; a bad picture is a 400."""
    from transformers import AutoTokenizer

    from agentrl.images import load_image

    tok = AutoTokenizer.from_pretrained(tiny_vlm)
    expansion = "<fake_token_around_image><global-img>" + "<image>" * 4 + "<fake_token_around_image>"
    url = load_image(PILImage.new("RGB", (24, 24), (30, 200, 30))).url
    part = {"type": "image_url", "image_url": {"url": url}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, part]}], "max_tokens": 4}
    tool = {"type": "function", "function": {"name": "zoom", "parameters": {"type": "object", "properties": {}}}}
    async with httpx.AsyncClient(base_url=tiny_vlm_server, timeout=60) as http:
        ok = await http.post("/v1/chat/completions", json=body)
        assert ok.status_code == 200, ok.text
        rendered = "<|im_start|>user\nwhat?" + expansion + "<|im_end|>\n<|im_start|>assistant\n"
        assert ok.json()["usage"]["prompt_tokens"] == len(tok.encode(rendered, add_special_tokens=False))
        with_tools = await http.post("/v1/chat/completions", json={**body, "tools": [tool]})
        assert with_tools.status_code == 200, with_tools.text  # the built-in tool template writes the marker
        assert with_tools.json()["usage"]["prompt_tokens"] > ok.json()["usage"]["prompt_tokens"]
        bad = {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
            ]
        }
        refused = await http.post("/v1/chat/completions", json=bad)
        assert refused.status_code == 400 and "not a decodable image" in refused.json()["error"]["message"]
        # SGLang's native /generate with a text prompt holding the marker: the processor expands it
        text = "<|im_start|>user\n<image>hi"
        want = len(tok.encode(text.replace("<image>", expansion), add_special_tokens=False))
        one = await http.post(
            "/generate", json={"text": text, "image_data": url, "sampling_params": {"max_new_tokens": 2}}
        )
        assert one.status_code == 200 and one.json()["meta_info"]["prompt_tokens"] == want, one.text
        # a batch: one list of pictures per input (None for a text-only one); a bad picture refuses the batch
        ids = tok.encode(text.replace("<image>", expansion), add_special_tokens=False)
        batch = {"input_ids": [ids, [1, 2, 3]], "image_data": [[url], None], "sampling_params": {"max_new_tokens": 2}}
        both = await http.post("/generate", json=batch)
        assert both.status_code == 200 and [o["meta_info"]["prompt_tokens"] for o in both.json()] == [want, 3]
        broken = await http.post("/generate", json={**batch, "image_data": [["data:image/png;base64,AAAA"], None]})
        assert broken.status_code == 400 and "image_data[0]" in broken.text
        # a stream with a picture ends as the same request would
        chunks = []
        async with http.stream(
            "POST",
            "/generate",
            json={"input_ids": ids, "image_data": [url], "stream": True, "sampling_params": {"max_new_tokens": 3}},
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data:") and line.strip() != "data: [DONE]":
                    chunks.append(json.loads(line[5:]))
        assert chunks and chunks[-1]["meta_info"]["prompt_tokens"] == want and chunks[-1]["meta_info"]["finish_reason"]


def test_agentrl_train_runs_the_shapes_env_on_a_vlm_and_view_draws_its_pictures(tiny_vlm, tmp_path, ray_local):
    save = tmp_path / "run"
    args = ["train", "--env", "agentrl.envs.shapes:Shapes", "--hf-checkpoint", str(tiny_vlm), "--num-rollout", "2"]
    args += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4"]
    args += ["--rollout-max-turn-len", "16", "--save", str(save)]
    done = run_cli(*args, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1] and lines[-1]["weight_version"] == 2
    dump = [json.loads(line) for line in (save / "rollouts" / "rollout_000001.jsonl").read_text().splitlines()]
    assert all(len(d["multimodal_inputs"]["images"]) >= 1 for d in dump)
    final = save / "iter_0000002"
    assert vision_for(final) is not None  # the saved model is a VLM with its processor
    page = tmp_path / "view.html"
    shown = run_cli("view", str(save / "rollouts" / "rollout_000001.jsonl"), "--output", str(page))
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert dump[0]["multimodal_inputs"]["images"][0] in page.read_text()


class LastPictureOnly(Shapes):
    """Keeps only the newest picture in the conversation (what a GUI agent does with old screenshots)."""

    async def rewrite_history(self, messages):
        pictures = [i for i, m in enumerate(messages) if isinstance(m.get("content"), list)]
        out = []
        for i, m in enumerate(messages):
            if i in pictures[:-1]:
                text = "".join(p.get("text", "") for p in m["content"] if p.get("type") == "text")
                m = {**m, "content": "[an earlier picture] " + text}
            out.append(m)
        return out


async def test_a_history_rewrite_that_drops_old_pictures_starts_segments_with_their_own_images(
    tiny_vlm_server, tiny_vlm
):
    ctx = _ctx(tiny_vlm_server, tiny_vlm, n_samples_per_prompt=1)
    tasks = Shapes.tasks(2, seed=5, pictures=3)
    samples, _ = await generate_rollout(ctx, LastPictureOnly, tasks)
    await ctx.engine.close()
    assert len(samples) == 2 * 3  # a segment per picture: each rewrite changed an earlier turn
    vision = ctx.template.vision
    for s in samples:
        s.validate()
        assert s.status == Status.COMPLETED, s.metadata
        images = s.multimodal_inputs["images"]
        assert len(images) == 1 and s.tokens.count(vision.image_token_id) == 4  # only the newest picture
        counts = [int(c) for c in s.label.split(",")]
        assert count_regions(images[0]) == counts[s.metadata["segment"]]
    batch = _train_samples(samples)
    old = (
        TorchTrainer(tiny_vlm, TrainConfig(global_batch_size=len(batch), seed=0))
        .compute_log_probs(batch, ref=False)
        .old
    )
    for s, lp in zip(batch, old):
        m = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert (torch.tensor(lp)[m] - torch.tensor(s.rollout_log_probs)[m]).abs().max() < 1e-4


async def test_a_policy_that_samples_the_placeholder_token_fails_its_sample(tmp_path):
    """A sampled ``<image>`` would be taken for a picture by the engine's next request and by the trainer:
    the sample ends there, failed with the reason, and the run goes on."""
    from transformers import Idefics3ForConditionalGeneration

    from agentrl.engines.local.process import local_server
    from agentrl.tiny import build_vlm

    ckpt = build_vlm(tmp_path / "vlm")
    model = Idefics3ForConditionalGeneration.from_pretrained(ckpt)
    with torch.no_grad():  # the placeholder's logit far above every other token's
        model.lm_head.weight[model.config.image_token_id] = model.model.text_model.embed_tokens.weight.mean(0) * 50
        model.lm_head.weight[model.config.image_token_id, 0] = 50.0
    model.save_pretrained(ckpt)
    with local_server(ckpt, log_path=tmp_path / "engine.log", extra_args=["--seed", "0"], startup_timeout=120) as url:
        ctx = _ctx(url, ckpt)
        samples, _ = await generate_rollout(ctx, Shapes, Shapes.tasks(2))
        await ctx.engine.close()
    for s in samples:
        assert s.status == Status.FAILED and s.status_reason == "image_token_sampled", s.metadata
        assert "'<image>'" in s.metadata["error"] and len(s.turn_spans) == 1


async def test_pictures_cross_the_openenv_boundary_as_data_urls():
    """``agentrl env-serve`` sends a Python env's PIL pictures as data-URL image parts; the ``openenv:``
    adapter hands them to the episode as such, and the solver reads the same pictures through it."""
    from agentrl.adapters.openenv_server import EnvServer
    from agentrl.envs.shapes import solver_policy
    from agentrl.rollout.scripted import play
    from tests.serving import serve_app

    tasks = Shapes.tasks(3, seed=9)
    with serve_app(EnvServer(Shapes, tasks=tasks, max_sessions=4).app()) as url:
        remote = agentrl.load_env(f"openenv:{url}")
        results = await play(remote, solver_policy, tasks)
    assert [r.error for r in results] == [None] * 3
    assert all(r.reward == pytest.approx(1.0) for r in results)
    first = results[0].messages[0]["content"]
    assert first[0]["type"] == "image_url" and first[0]["image_url"]["url"].startswith("data:image/png;base64,")


class CaptionNewest(Shapes):
    """Rewrites only the newest observation (a caption on its picture): the ledger extends, one sample."""

    async def rewrite_history(self, messages):
        last = messages[-1]
        return [*messages[:-1], {**last, "content": [*last["content"], {"type": "text", "text": " (newest)"}]}]


class SwapFirst(Shapes):
    """Replaces the first picture with another of the same size (nine shapes) after the first turn."""

    async def rewrite_history(self, messages):
        from agentrl.envs.shapes import draw

        first = messages[0]
        if count_regions(first["content"][0]["image_url"]["url"]) == 9:
            return None
        picture = {"type": "image", "image": draw(1, 9, size=self.size)}
        return [{**first, "content": [picture, *first["content"][1:]]}, *messages[1:]]


async def test_a_rewrite_that_only_extends_keeps_one_sample_with_every_picture(tmp_path):
    """The re-rendered conversation must reproduce every sampled id for the rewrite to extend the ledger: a
    model that ends each turn at once (its turns re-tokenize exactly) isolates what the pictures change."""
    from agentrl.engines.local.process import local_server
    from agentrl.tiny import build_vlm

    ckpt = build_vlm(tmp_path / "terse", mean_turn_tokens=1.0)
    with local_server(ckpt, log_path=tmp_path / "engine.log", extra_args=["--seed", "0"], startup_timeout=120) as url:
        ctx = _ctx(url, ckpt, n_samples_per_prompt=1)
        samples, _ = await generate_rollout(ctx, CaptionNewest, Shapes.tasks(2, seed=6, pictures=3))
        await ctx.engine.close()
        ctx = _ctx(url, ckpt, n_samples_per_prompt=1)
        swapped, _ = await generate_rollout(ctx, SwapFirst, Shapes.tasks(1, seed=7, pictures=2))
        await ctx.engine.close()
    # a picture swapped for another of its size: same placeholder ids, different picture, so a new segment
    assert [s.metadata["segment"] for s in swapped] == [0, 1]
    assert [count_regions(u) for u in swapped[1].multimodal_inputs["images"]][0] == 9
    assert count_regions(swapped[0].multimodal_inputs["images"][0]) == int(swapped[0].label.split(",")[0])
    tiny_vlm = ckpt
    for s in samples:
        s.validate()
        assert s.status == Status.COMPLETED and s.metadata["history_rewrites"] == 2, s.metadata
        assert s.metadata.get("num_segments") is None and len(s.turn_spans) == 3
        assert len(s.multimodal_inputs["images"]) == 3 and s.metadata["image_tokens"] == [4, 4, 4]
        assert ctx.template.decode(s.tokens).count(" (newest)") == 2
        assert [count_regions(u) for u in s.multimodal_inputs["images"]] == [int(c) for c in s.label.split(",")]
    batch = _train_samples(samples)
    old = TorchTrainer(tiny_vlm, TrainConfig(global_batch_size=2, seed=0)).compute_log_probs(batch, ref=False).old
    for s, lp in zip(batch, old):
        m = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert (torch.tensor(lp)[m] - torch.tensor(s.rollout_log_probs)[m]).abs().max() < 1e-4


async def test_a_text_only_model_fails_picture_episodes_with_the_reason(tiny_server, tiny_ckpt):
    from transformers import AutoTokenizer

    ctx = EpisodeContext(
        engine=SGLangEngine(tiny_server),
        template=ChatTemplate(AutoTokenizer.from_pretrained(tiny_ckpt)),
        config=RolloutConfig(rollout_max_turn_len=16, max_turns=2),
    )
    samples, _ = await generate_rollout(ctx, Shapes, Shapes.tasks(2))
    await ctx.engine.close()
    for s in samples:
        assert s.status == Status.FAILED and s.status_reason == "image", s.metadata
        assert "the model is text-only" in s.metadata["error"]


async def test_the_chat_completions_adapter_sends_the_pictures_as_image_parts(tiny_vlm_server, tiny_vlm):
    """``--engine-api chat`` (evaluation of API models): the conversation goes out with its pictures as OpenAI
    image parts; the samples are marked not token-exact, as every chat-completions sample is."""
    from transformers import AutoTokenizer

    from agentrl.engines.http import ChatCompletionsEngine

    template = ChatTemplate(AutoTokenizer.from_pretrained(tiny_vlm), vision=vision_for(tiny_vlm))
    engine = ChatCompletionsEngine(tiny_vlm_server, template)
    ctx = EpisodeContext(engine=engine, template=template, config=RolloutConfig(rollout_max_turn_len=200, max_turns=4))
    samples, _ = await generate_rollout(ctx, Shapes, Shapes.tasks(2, seed=4))
    await engine.close()
    for s in samples:
        assert s.status == Status.COMPLETED and not s.token_exact, s.metadata
        assert len(s.turn_spans) == 2 and len(s.multimodal_inputs["images"]) == 2


class PictureDebate(agentrl.Env):
    """Two roles take 4 turns in turn; a sees a picture at reset, and each role is shown the next picture
    (``count`` shapes, ``count`` = 1, 2, 3, ...) when the other one has answered."""

    roles = ("a", "b")

    def _picture(self) -> agentrl.Message:
        from agentrl.envs.shapes import draw

        self.shown += 1
        img = draw(self.shown, self.shown)
        return {"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "How many?"}]}

    async def reset(self, *, seed=None, options=None):
        self.turn, self.who, self.shown = 0, "a", 0
        return {"a": [self._picture()], "b": [{"role": "user", "content": "Wait for a picture."}]}, {}

    def current_role(self):
        return self.who

    async def step(self, action):
        self.turn += 1
        if self.turn >= 4:
            return {}, 1.0, True, False, {}
        self.who = "b" if self.who == "a" else "a"
        return {self.who: [self._picture()]}, 0.0, False, False, {}


async def test_each_role_sees_its_own_pictures_token_exact(tiny_vlm_server, tiny_vlm):
    ctx = _ctx(tiny_vlm_server, tiny_vlm, rollout_temperature=1.0)
    samples, _ = await generate_rollout(ctx, PictureDebate, [{"prompt": "x"}])
    await ctx.engine.close()
    vision = ctx.template.vision
    by_role = {s.role: s for s in samples}
    assert set(by_role) == {"a", "b"}
    # a: the reset's picture and the one after b's first answer; b: the one shown before its first turn
    # (part of its prompt) and the one after a's second answer
    for role, counts in (("a", [1, 3]), ("b", [2, 4])):
        s = by_role[role]
        s.validate()
        assert s.status == Status.COMPLETED, s.metadata
        assert [count_regions(u) for u in s.multimodal_inputs["images"]] == counts, role
        assert [len(v) for v in s.multimodal_train_inputs.values()] == [2, 2]
        placeholders = [j for j, t in enumerate(s.tokens[s.prompt_length :]) if t == vision.image_token_id]
        assert s.tokens[: s.prompt_length].count(vision.image_token_id) == 4 and len(placeholders) == 4
        assert all(s.loss_mask[j] == 0 for j in placeholders)
    batch = _train_samples(samples)  # the trainer re-scores each role's tokens with that role's pictures
    trainer = TorchTrainer(tiny_vlm, TrainConfig(lr=1e-2, global_batch_size=len(batch), seed=0))
    for s, lp in zip(batch, trainer.compute_log_probs(batch, ref=False).old):
        m = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert (torch.tensor(lp)[m] - torch.tensor(s.rollout_log_probs)[m]).abs().max() < 1e-4
