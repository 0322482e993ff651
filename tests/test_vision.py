"""Images in observations, in-process: decoding and limits, the processor's placeholders in the ledger, the
embedded engine's image features and prefix keys, the torch trainer on packed samples with images, dumps
and the viewer. The tiny VLM (Idefics3, SmolVLM's architecture) is built locally; nothing is downloaded."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from agentrl.chat import ChatTemplate, TemplateError
from agentrl.config import RunConfig, TrainConfig
from agentrl.engines.local.engine import LocalEngine
from agentrl.engines.local.sampling import InvalidRequestError
from agentrl.envs.shapes import Shapes, count_regions, draw, guess_policy, solver_policy
from agentrl.images import ImageError, load_image, normalize, template_messages
from agentrl.rollout.scripted import play_sync
from agentrl.trainer.base import TrainSample
from agentrl.trainer.torch_trainer import TorchTrainer
from agentrl.types import Sample
from agentrl.view import render_html
from agentrl.vlm import load_vision_model, vision_for


def png_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def picture(color=(200, 30, 30), size=(40, 24)):
    return PILImage.new("RGB", size, color)


@pytest.fixture(scope="module")
def template(tiny_vlm):
    from transformers import AutoTokenizer

    return ChatTemplate(AutoTokenizer.from_pretrained(tiny_vlm), vision=vision_for(tiny_vlm))


# -- images: what an env may hand over ----------------------------------------------------------


def test_images_decode_from_pil_data_and_file_urls_to_one_lossless_form(tmp_path):
    img = picture()
    path = tmp_path / "a.png"
    img.save(path)
    a, b, c = load_image(img), load_image(png_url(img)), load_image(f"file://{path}")
    assert a.url == b.url == c.url and a.digest == b.digest == c.digest
    assert np.array_equal(np.asarray(load_image(a.url).pil), np.asarray(img))  # the data URL is lossless
    assert load_image(picture((0, 0, 1))).digest != a.digest  # one value of one pixel channel apart


@pytest.mark.parametrize(
    "source, words",
    [
        ("https://example.com/a.png", "remote image URLs are not fetched"),
        ("data:image/png;base64,@@@", "bad base64"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not a decodable image"),
        ("file:///nonexistent/a.png", "does not exist"),
        ("ftp://x/a.png", "scheme 'ftp'"),
        (42, "PIL image or a data:/file:// URL"),
    ],
)
def test_unusable_images_are_refused_with_the_reason(source, words):
    with pytest.raises(ImageError, match=words):
        load_image(source)


def test_an_oversized_image_is_refused_before_it_is_decoded():
    url = png_url(picture(size=(300, 200)))
    with pytest.raises(ImageError, match="300x200 pixels is over the 10000-pixel limit"):
        load_image(url, max_pixels=10_000)


def test_normalize_rewrites_every_image_part_as_a_data_url_in_order():
    first, second = picture((1, 2, 3)), picture((4, 5, 6))
    messages = [
        {"role": "system", "content": "plain"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image", "image": first},
                {"type": "image_url", "image_url": {"url": png_url(second)}},
            ],
        },
    ]
    out, images = normalize(messages)
    assert [im.digest for im in images] == [load_image(first).digest, load_image(second).digest]
    assert out[0] == messages[0]
    assert [p["type"] for p in out[1]["content"]] == ["text", "image_url", "image_url"]
    assert out[1]["content"][1]["image_url"]["url"] == images[0].url
    json.dumps(out)  # JSON-safe from here on
    assert template_messages(out)[1]["content"] == [
        {"type": "text", "text": "look"},
        {"type": "image"},
        {"type": "image"},
    ]
    with pytest.raises(ImageError, match="message 0 part 0: content part type 'audio'"):
        normalize([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}])


# -- the ledger: the processor's placeholders ----------------------------------------------------


def test_prompt_and_deltas_carry_exactly_the_processors_placeholders(template, tiny_vlm):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vlm)
    msgs, images = normalize(
        [{"role": "user", "content": [{"type": "text", "text": "count"}, {"type": "image", "image": picture()}]}]
    )
    text, expanded = template.prompt_images(msgs, images)
    want = processor(text=text, images=[images[0].pil], add_special_tokens=False)["input_ids"][0]
    assert expanded.ids == list(want)
    vision = template.vision
    assert expanded.ids.count(vision.image_token_id) == expanded.num_tokens[0] == 4
    assert expanded.pixels[0]["pixel_values"].shape == (1, 3, 32, 32)
    # an observation delta with two images: each expanded in order, text tokenized as before
    obs, more = normalize(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": picture((9, 9, 9))},
                    {"type": "text", "text": "and"},
                    {"type": "image", "image": picture()},
                ],
            }
        ]
    )
    delta = template.observation_delta(obs, last_token_text="<|im_end|>")
    out = template.encode_images(delta, more)
    assert out.ids.count(vision.image_token_id) == 8 and len(out.pixels) == 2
    assert template.decode(out.ids).replace("<image>" * 4, "<image>").count("<image>") == 2


def test_text_holding_the_marker_or_images_for_a_text_model_are_refused(template, tiny_ckpt):
    from transformers import AutoTokenizer

    msgs, images = normalize(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a literal <image> here"}, {"type": "image", "image": picture()}],
            }
        ]
    )
    with pytest.raises(TemplateError, match=r"2 image marker\(s\) '<image>' for 1 image"):
        template.prompt_images(msgs, images)
    text_only = ChatTemplate(AutoTokenizer.from_pretrained(tiny_ckpt))
    with pytest.raises(TemplateError, match="the model is text-only"):
        text_only.encode_images("x", images)
    with pytest.raises(TemplateError, match="render them with prompt_images"):
        text_only.prompt(msgs)


# -- the embedded engine ---------------------------------------------------------------------


def _hf_log_probs(model, ids: list[int], pixels: list[dict]) -> torch.Tensor:
    """Per-position log-probs of ``ids[1:]`` from transformers' own forward with ``pixel_values``."""
    pv = torch.cat([torch.as_tensor(p["pixel_values"]) for p in pixels])[None]
    pam = torch.cat([torch.as_tensor(p["pixel_attention_mask"]) for p in pixels])[None]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), pixel_values=pv, pixel_attention_mask=pam).logits[0].float()
    return logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_engine_log_probs_equal_transformers_and_the_prefix_cache_is_keyed_on_the_picture(template, tiny_vlm):
    msgs, images = normalize(
        [{"role": "user", "content": [{"type": "text", "text": "count"}, {"type": "image", "image": picture()}]}]
    )
    _, ex = template.prompt_images(msgs, images)
    first = ex.ids.index(template.vision.image_token_id)
    other = load_image(picture((10, 200, 10)))

    async def run():
        engine = LocalEngine(tiny_vlm, seed=0)
        try:
            out = await engine.generate(
                ex.ids, {"max_new_tokens": 12, "temperature": 1.0}, return_logprob=True, image_data=[images[0].url]
            )
            again = await engine.generate(ex.ids, {"max_new_tokens": 2}, image_data=[images[0].url])
            swapped = await engine.generate(ex.ids, {"max_new_tokens": 2}, image_data=[other.url])
            errors = []
            for kwargs in (
                {},
                {"image_data": ["data:image/png;base64,AAAA"]},
                {"image_data": [images[0].url, other.url]},
            ):
                with pytest.raises(InvalidRequestError) as err:
                    await engine.generate(ex.ids, {"max_new_tokens": 2}, **kwargs)
                errors.append(str(err.value))
            return out, again, swapped, errors
        finally:
            await engine.close()

    out, again, swapped, errors = asyncio.run(run())
    lps = out["meta_info"]["output_token_logprobs"]
    ids = ex.ids + [t for _, t, _ in lps]
    ref = _hf_log_probs(load_vision_model(tiny_vlm, torch.float32, "cpu").eval(), ids, ex.pixels)[len(ex.ids) - 1 :]
    assert (ref - torch.tensor([lp for lp, _, _ in lps])).abs().max() < 1e-4
    assert again["meta_info"]["cached_tokens"] == len(ex.ids) - 1  # the same picture: the whole prompt reused
    assert swapped["meta_info"]["cached_tokens"] == first  # another picture: nothing past its first placeholder
    assert "4 image placeholder token(s)" in errors[0] and "no image_data" in errors[0]
    assert errors[1].startswith("image_data[0]: ") and "not a decodable image" in errors[1]
    assert "2 image(s) take 8 placeholder tokens" in errors[2]


def test_a_text_only_engine_refuses_image_data(tiny_ckpt):
    async def run():
        engine = LocalEngine(tiny_ckpt, seed=0)
        try:
            with pytest.raises(InvalidRequestError, match="text-only"):
                await engine.generate([1, 2, 3], {"max_new_tokens": 1}, image_data=[load_image(picture()).url])
        finally:
            await engine.close()

    asyncio.run(run())


# -- the trainer ---------------------------------------------------------------------------------


def _rollout(template, tiny_vlm, n: int = 3) -> list[TrainSample]:
    """Two-picture conversations sampled by the engine (mask 1) with the pictures' deltas (mask 0)."""

    async def run():
        engine = LocalEngine(tiny_vlm, seed=1)
        samples = []
        try:
            for k in range(n):
                first, second = draw(k, 1 + k % 4), draw(100 + k, 2)
                msgs, images = normalize(
                    [
                        {
                            "role": "user",
                            "content": [{"type": "image", "image": first}, {"type": "text", "text": "how many?"}],
                        }
                    ]
                )
                _, ex = template.prompt_images(msgs, images)
                ids, mask, lps, pixels = list(ex.ids), [], [], list(ex.pixels)
                urls = [images[0].url]
                for turn in range(2):
                    out = await engine.generate(
                        ids, {"max_new_tokens": 16, "temperature": 1.0}, return_logprob=True, image_data=urls
                    )
                    got = out["meta_info"]["output_token_logprobs"]
                    ids += [t for _, t, _ in got]
                    lps += [lp for lp, _, _ in got]
                    mask += [1] * len(got)
                    if turn == 0:
                        obs, more = normalize(
                            [
                                {
                                    "role": "user",
                                    "content": [
                                        {"type": "image", "image": second},
                                        {"type": "text", "text": "and now?"},
                                    ],
                                }
                            ]
                        )
                        delta = template.encode_images(template.observation_delta(obs, last_token_text=None), more)
                        ids += delta.ids
                        lps += [0.0] * len(delta.ids)
                        mask += [0] * len(delta.ids)
                        pixels += delta.pixels
                        urls.append(more[0].url)
                train = {k: [p[k] for p in pixels] for k in pixels[0]}
                samples.append(
                    TrainSample(
                        tokens=ids,
                        response_length=len(mask),
                        loss_mask=mask,
                        rollout_log_probs=lps,
                        advantages=[1.0 if k % 2 else -1.0] * len(mask),
                        multimodal_train_inputs=train,
                    )
                )
        finally:
            await engine.close()
        return samples, len(ex.ids)

    return asyncio.run(run())


@pytest.mark.parametrize("freeze", [True, False])
def test_the_trainer_rescores_packed_samples_with_two_images_and_trains(template, tiny_vlm, freeze):
    samples, _ = _rollout(template, tiny_vlm)
    trainer = TorchTrainer(
        tiny_vlm, TrainConfig(lr=1e-2, global_batch_size=len(samples), seed=0, freeze_vision_tower=freeze)
    )
    old = trainer.compute_log_probs(samples, ref=False).old  # the samples packed into one row
    for s, lp in zip(samples, old):
        rescored = torch.tensor(lp)[torch.tensor(s.loss_mask, dtype=torch.bool)]
        rollout = torch.tensor(s.rollout_log_probs)[torch.tensor(s.loss_mask, dtype=torch.bool)]
        assert (rescored - rollout).abs().max() < 1e-4
        placeholders = [j for j, t in enumerate(s.tokens[-s.response_length :]) if t == template.vision.image_token_id]
        assert len(placeholders) == 4 and all(s.loss_mask[j] == 0 for j in placeholders)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.train_step(samples)
    assert metrics["grad_norm"] > 0
    changed = {k for k, v in trainer.model.state_dict().items() if not torch.equal(before[k], v)}
    assert any("text_model" in k for k in changed) and any("connector" in k for k in changed)
    assert any("vision_model" in k for k in changed) is (not freeze)


def test_a_sample_whose_images_do_not_match_its_placeholders_is_refused(template, tiny_vlm):
    samples, _ = _rollout(template, tiny_vlm, n=1)
    s = samples[0]
    s.multimodal_train_inputs = {k: v[:1] for k, v in s.multimodal_train_inputs.items()}  # one picture lost
    trainer = TorchTrainer(tiny_vlm, TrainConfig(global_batch_size=1, seed=0))
    with pytest.raises(ValueError, match="1 image\\(s\\) give 4 feature rows for 8 placeholder tokens"):
        trainer.compute_log_probs(samples, ref=False)


# -- config, dumps, the viewer, the env --------------------------------------------------------


def test_megatron_and_critics_refuse_a_vision_policy_before_anything_starts(tiny_vlm):
    from agentrl.runtime.preflight import _check_vision

    with pytest.raises(ValueError, match="--train-backend megatron: .* vision-language model"):
        _check_vision(RunConfig(train_backend="megatron"), tiny_vlm)
    with pytest.raises(ValueError, match="without a critic"):
        _check_vision(RunConfig(train=TrainConfig(advantage_estimator="ppo")), tiny_vlm)
    _check_vision(RunConfig(), tiny_vlm)  # torch + GRPO: fine


def test_a_dump_round_trips_the_images_and_the_trainer_processes_them_again(template, tiny_vlm):
    """A dump keeps the pictures (lossless PNG data URLs), not the processor's arrays (often 100x larger): a
    sample read back trains exactly as the rollout's own, its images processed again by the trainer."""
    samples, _ = _rollout(template, tiny_vlm, n=2)
    urls = [[load_image(draw(k, 1 + k % 4)).url, load_image(draw(100 + k, 2)).url] for k in range(2)]
    dumped = []
    for t, u in zip(samples, urls):
        s = Sample(tokens=t.tokens, response_length=t.response_length, loss_mask=t.loss_mask)
        s.rollout_log_probs = t.rollout_log_probs
        s.multimodal_inputs, s.multimodal_train_inputs = {"images": u}, t.multimodal_train_inputs
        dumped.append(json.loads(s.to_json()))
    assert all(d["multimodal_train_inputs"] is None and d["multimodal_inputs"]["images"] for d in dumped)
    back = [Sample.from_dict(d) for d in dumped]
    assert [count_regions(u) for u in back[1].multimodal_inputs["images"]] == [2, 2]
    again = [
        TrainSample(
            tokens=b.tokens,
            response_length=b.response_length,
            loss_mask=b.loss_mask,
            multimodal_inputs=b.multimodal_inputs,
        )
        for b in back
    ]
    trainer = TorchTrainer(tiny_vlm, TrainConfig(global_batch_size=2, seed=0))
    assert trainer.compute_log_probs(again, ref=False).old == trainer.compute_log_probs(samples, ref=False).old
    for a, t in zip(again, samples):  # the same arrays the rollout made
        for k, arrays in t.multimodal_train_inputs.items():
            assert all(np.array_equal(x, y) for x, y in zip(arrays, a.multimodal_train_inputs[k]))


def test_the_viewer_draws_images_where_their_placeholders_start(template):
    msgs, images = normalize(
        [{"role": "user", "content": [{"type": "image", "image": draw(1, 2)}, {"type": "text", "text": "n?"}]}]
    )
    text, ex = template.prompt_images(msgs, images)
    s = Sample(tokens=ex.ids + [5, 6], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-1.0, -1.0])
    s.multimodal_inputs = {"images": [images[0].url]}
    bad = Sample(tokens=[1, 2], response_length=1, loss_mask=[1], rollout_log_probs=[-1.0])
    bad.multimodal_inputs = {"images": ['data:image/png;base64,x" onerror="alert(1)']}
    page = render_html([s, bad], template.tokenizer)
    blob = page.split('<script type="application/json" id="agentrl-data">', 1)[1].split("</script>", 1)[0]
    records = json.loads(blob)["samples"]
    assert records[0]["img"] == [images[0].url]
    assert records[0]["ia"] == [ex.ids.index(template.vision.image_token_id)]  # drawn at its first placeholder
    assert "img" not in records[1] and "not base64 image data URLs" in records[1]["bad"]
    assert "onerror" not in page.split('id="agentrl-data"', 1)[0]  # nothing of it reaches the markup


def test_the_shapes_solver_reads_the_pictures_and_the_baseline_does_not():
    tasks = Shapes.tasks(16, seed=3)
    solved = play_sync(Shapes, solver_policy, tasks)
    guessed = play_sync(Shapes, guess_policy, tasks)
    assert all(r.reward == pytest.approx(1.0) for r in solved), [r.reward for r in solved]
    assert sum(r.reward for r in guessed) / len(guessed) < 0.5
    for seed, count in ((1, 1), (2, 6), (3, 9)):
        assert count_regions(draw(seed, count)) == count


def test_a_bad_shapes_task_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="'label' must list"):
        asyncio.run(Shapes().reset(options={"label": "0,3"}))
    with pytest.raises(ValueError, match="'size' must be a whole number from 48 to 512"):
        asyncio.run(Shapes().reset(options={"label": "3", "size": 8}))


async def test_check_env_passes_shapes_and_catches_an_undecodable_picture():
    import agentrl

    report = await agentrl.check_env(Shapes, Shapes.tasks(2))
    assert report.ok, report.format()
    assert "1 image(s)" in report.format()

    class Broken(Shapes):
        async def reset(self, *, seed=None, options=None):
            obs, info = await super().reset(seed=seed, options=options)
            obs[0]["content"][0] = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
            return obs, info

    bad = await agentrl.check_env(Broken, Shapes.tasks(1))
    assert not bad.ok and "not a decodable image" in bad.format()


def test_the_builtin_tool_template_writes_images_as_the_models_marker(template):
    from agentrl.tool import tool

    @tool
    def zoom(factor: int) -> str:
        """Zoom in.

        Args:
            factor: how much
        """
        return "ok"

    msgs, images = normalize(
        [{"role": "user", "content": [{"type": "image", "image": picture()}, {"type": "text", "text": "n?"}]}]
    )
    text, ex = template.prompt_images(msgs, images, [zoom.schema()])
    assert "<tools>" in text and "<image>n?" in text  # the tiny VLM's template ignores tools: the built-in one ran
    assert ex.ids.count(template.vision.image_token_id) == 4


def test_split_images_take_one_placeholder_run_per_crop_and_match_transformers(tmp_path):
    """SmolVLM's processor cuts a large image into crops plus a global view: every crop's features land on its
    own placeholders, in the processor's order (engine log-probs equal transformers' own forward)."""
    from transformers import AutoTokenizer

    from agentrl.tiny import build_vlm

    ckpt = build_vlm(tmp_path / "split", split_images=True)
    template = ChatTemplate(AutoTokenizer.from_pretrained(ckpt), vision=vision_for(ckpt))
    msgs, images = normalize(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": draw(4, 5, size=80)},
                    {"type": "text", "text": "and"},
                    {"type": "image", "image": picture()},
                ],
            }
        ]
    )
    text, ex = template.prompt_images(msgs, images)
    assert ex.num_tokens == [20, 20] and "<row_2_col_2>" in template.decode(ex.ids)  # 2x2 crops + global, 4 each

    async def run():
        engine = LocalEngine(ckpt, seed=0)
        try:
            return await engine.generate(
                ex.ids, {"max_new_tokens": 8}, return_logprob=True, image_data=[im.url for im in images]
            )
        finally:
            await engine.close()

    lps = asyncio.run(run())["meta_info"]["output_token_logprobs"]
    ids = ex.ids + [t for _, t, _ in lps]
    ref = _hf_log_probs(load_vision_model(ckpt, torch.float32, "cpu").eval(), ids, ex.pixels)[len(ex.ids) - 1 :]
    assert (ref - torch.tensor([lp for lp, _, _ in lps])).abs().max() < 1e-4
    # the viewer finds each split picture's first placeholder from the sample's per-image counts
    s = Sample(
        tokens=ids, response_length=len(lps), loss_mask=[1] * len(lps), rollout_log_probs=[lp for lp, _, _ in lps]
    )
    s.multimodal_inputs, s.metadata["image_tokens"] = {"images": [im.url for im in images]}, ex.num_tokens
    page = render_html([s], template.tokenizer)
    blob = page.split('<script type="application/json" id="agentrl-data">', 1)[1].split("</script>", 1)[0]
    at = [j for j, t in enumerate(ids) if t == template.vision.image_token_id]
    assert json.loads(blob)["samples"][0]["ia"] == [at[0], at[20]]


async def test_demonstrations_with_pictures_lay_down_the_placeholders_a_rollout_would(template):
    """Warm starts for VLM agents: a scripted solver's episodes and conversation rows with image parts become
    samples whose pictures' placeholders are mask 0, as the episode loop lays them down."""
    from agentrl.rollout.demo_checks import DemoError
    from agentrl.rollout.demos import conversation_samples, scripted_samples

    samples, stats = await scripted_samples(Shapes, solver_policy, Shapes.tasks(3, seed=2), template)
    ph = template.vision.image_token_id
    assert len(samples) == 3 and stats.rows == 3
    for s in samples:
        assert s.token_exact and len(s.multimodal_inputs["images"]) == 2
        assert [len(v) for v in s.multimodal_train_inputs.values()] == [2, 2]
        assert s.tokens.count(ph) == 8 and s.tokens[: s.prompt_length].count(ph) == 4
        resp = s.tokens[s.prompt_length :]
        assert all(m == 0 for t, m in zip(resp, s.loss_mask) if t == ph)
        assert s.prompt[0]["content"][0]["type"] == "image_url"  # JSON-safe: the PIL picture became a data URL
        json.dumps(s.prompt)
    url = load_image(draw(7, 3)).url
    row = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "n?"}],
            },
            {"role": "assistant", "content": "<answer>3</answer>"},
        ]
    }
    (one,), _ = conversation_samples([("row 1", row)], template)
    assert one.multimodal_inputs == {"images": [url]} and one.tokens.count(ph) == 4
    bad = {"messages": [{"role": "user", "content": [{"type": "video"}]}, {"role": "assistant", "content": "x"}]}
    with pytest.raises(DemoError, match=r"row 2: messages\[0\] part 0: content part type 'video'"):
        conversation_samples([("row 2", bad)], template)


def test_transparent_pixels_become_white_as_transformers_makes_them(tmp_path):
    rgba = PILImage.new("RGBA", (4, 2), (10, 20, 30, 0))  # fully transparent
    rgba.putpixel((0, 0), (200, 0, 0, 255))  # one opaque red pixel
    img = load_image(png_url(rgba))
    assert img.pil.getpixel((0, 0)) == (200, 0, 0) and img.pil.getpixel((1, 0)) == (255, 255, 255)
    palette = PILImage.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 9, 9, 9] + [0] * 762)
    palette.info["transparency"] = 0
    assert load_image(palette).pil.getpixel((0, 0)) == (255, 255, 255)


def test_file_urls_name_a_local_absolute_path_and_servers_refuse_them(tmp_path):
    path = tmp_path / "a.png"
    picture().save(path)
    with pytest.raises(ImageError, match="names host 'images'"):
        load_image("file://images/a.png")
    assert load_image(f"file://localhost{path}").digest == load_image(picture()).digest
    with pytest.raises(ImageError, match="file:// image URLs are not read here"):
        load_image(f"file://{path}", files=False)


def test_text_parts_alone_render_as_one_string_on_a_text_model(tiny_tokenizer):
    text_only = ChatTemplate(tiny_tokenizer)
    parts = [{"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text", "text": "2 + 2?"}]}]
    assert text_only.prompt(parts) == text_only.prompt([{"role": "user", "content": "what is 2 + 2?"}])


def test_a_text_episode_on_a_vlm_tokenizes_as_the_tokenizer_does(template):
    msgs = [{"role": "user", "content": "no picture here"}]
    text, ex = template.prompt_images(msgs, [])
    assert ex.ids == template.encode(text) and ex.pixels == [] and ex.num_tokens == []


def test_the_freeze_flag_parses_and_defaults_to_frozen():
    from agentrl.cli import build_parser
    from agentrl.flags import run_config_from_values

    parser = build_parser()
    config = lambda *argv: run_config_from_values(vars(parser.parse_args(["train", *argv])))  # noqa: E731
    assert config().train.freeze_vision_tower is True
    assert config("--no-freeze-vision-tower").train.freeze_vision_tower is False
    assert config("--freeze-vision-tower").train.freeze_vision_tower is True


def test_prompt_log_probs_with_pictures_equal_transformers(template, tiny_vlm):
    """``input_token_logprobs`` from position 0 (slime's teacher scoring) over a prompt holding a picture."""
    msgs, images = normalize(
        [{"role": "user", "content": [{"type": "image", "image": draw(3, 4)}, {"type": "text", "text": "count"}]}]
    )
    _, ex = template.prompt_images(msgs, images)

    async def run():
        engine = LocalEngine(tiny_vlm, seed=0)
        try:
            return await engine.generate(
                ex.ids, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0, image_data=[images[0].url]
            )
        finally:
            await engine.close()

    scored = asyncio.run(run())["meta_info"]["input_token_logprobs"]
    ref = _hf_log_probs(load_vision_model(tiny_vlm, torch.float32, "cpu").eval(), ex.ids, ex.pixels)
    assert scored[0][0] is None and len(scored) == len(ex.ids)
    assert (ref - torch.tensor([lp for lp, _, _ in scored[1:]])).abs().max() < 1e-4


def test_a_weight_update_recomputes_the_pictures_features(template, tiny_vlm, tmp_path):
    """Features are cached by picture; new weights (the vision tower's among them) must not reuse them."""
    from transformers import Idefics3ForConditionalGeneration

    changed = tmp_path / "changed"
    model = Idefics3ForConditionalGeneration.from_pretrained(tiny_vlm)
    with torch.no_grad():
        for p in model.model.vision_model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(changed)
    msgs, images = normalize([{"role": "user", "content": [{"type": "image", "image": draw(5, 3)}]}])
    _, ex = template.prompt_images(msgs, images)

    async def run():
        engine = LocalEngine(tiny_vlm, seed=0)
        try:
            args = dict(return_logprob=True, logprob_start_len=0, image_data=[images[0].url])
            before = await engine.generate(ex.ids, {"max_new_tokens": 0}, **args)
            out = await engine.update_weights_from_disk(str(changed))
            assert out["success"], out
            after = await engine.generate(ex.ids, {"max_new_tokens": 0}, **args)
            return before, after
        finally:
            await engine.close()

    before, after = asyncio.run(run())
    ref = _hf_log_probs(load_vision_model(changed, torch.float32, "cpu").eval(), ex.ids, ex.pixels)
    got = torch.tensor([lp for lp, _, _ in after["meta_info"]["input_token_logprobs"][1:]])
    old = torch.tensor([lp for lp, _, _ in before["meta_info"]["input_token_logprobs"][1:]])
    assert (ref - got).abs().max() < 1e-4 and (old - got).abs().max() > 1e-3


def test_the_chunked_head_path_trains_packed_rows_with_pictures(template, tiny_vlm):
    """Above ``chunk_logits_above`` the trainer runs the decoder on inputs_embeds and the head in chunks."""
    samples, _ = _rollout(template, tiny_vlm, n=2)
    trainer = TorchTrainer(tiny_vlm, TrainConfig(global_batch_size=2, seed=0))
    assert trainer.chunked_logprobs
    trainer.chunk_logits_above = 0
    for s, lp in zip(samples, trainer.compute_log_probs(samples, ref=False).old):
        m = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert (torch.tensor(lp)[m] - torch.tensor(s.rollout_log_probs)[m]).abs().max() < 1e-4


def test_the_processors_chat_template_renders_when_the_tokenizer_has_none(tiny_vlm):
    """VLM repos keep their multimodal template with the processor (chat_template.json); AutoTokenizer may load none."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_vlm)
    tok.chat_template = None
    vision = vision_for(tiny_vlm)
    template = ChatTemplate(tok, vision=vision)
    assert template.native == vision.processor.chat_template
    msgs, images = normalize([{"role": "user", "content": [{"type": "image", "image": picture()}]}])
    assert template.prompt_images(msgs, images)[0] == "<|im_start|>user\n<image><|im_end|>\n<|im_start|>assistant\n"


LIST_ONLY_TEMPLATE = (  # SmolVLM's chat_template.json as published: it reads every content as a part list
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def test_a_vlm_template_that_reads_only_part_lists_renders_strings_as_text_parts(tiny_vlm):
    from transformers import AutoTokenizer

    template = ChatTemplate(
        AutoTokenizer.from_pretrained(tiny_vlm), template=LIST_ONLY_TEMPLATE, vision=vision_for(tiny_vlm)
    )
    msgs, images = normalize(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "image", "image": picture()}, {"type": "text", "text": "n?"}]},
        ]
    )
    text, ex = template.prompt_images(msgs, images)
    assert text == "<|im_start|>System: be brief<|im_end|>\nUser:<image>n?<|im_end|>\nAssistant:"
    assert ex.ids.count(template.vision.image_token_id) == 4
    delta = template.observation_delta(
        [{"role": "user", "content": "and now?"}], last_token_text="<|im_end|>", first_messages=msgs
    )
    assert delta == "\nUser: and now?<|im_end|>\nAssistant:"


def test_a_picture_taken_is_a_copy_and_its_arrays_are_read_only(template):
    canvas = picture((1, 2, 3))
    taken = load_image(canvas)
    canvas.putpixel((0, 0), (9, 9, 9))  # the env redraws its canvas in place
    assert taken.pil.getpixel((0, 0)) == (1, 2, 3) and taken.digest == load_image(picture((1, 2, 3))).digest
    arrays = template.vision.pixels(taken)
    assert not arrays["pixel_values"].flags.writeable
    with pytest.raises(ValueError):
        arrays["pixel_values"][0, 0, 0, 0] = 1.0
