"""slime's whole Sample: remove_sample, generate_function_path, non_generation_time, spec_info and the
multimodal fields, with their behaviour (the e2e half, a filter inside a training run, is in test_train.py)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

import agentrl
from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig, RunConfig, TrainConfig
from agentrl.data import task_from_row
from agentrl.engines.base import Engine, EngineError, GenerateOutput
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.runtime.collect import EpisodeCollector
from agentrl.types import Sample, Status


def test_every_slime_field_round_trips_through_a_dump():
    s = Sample(
        group_index=1,
        index=2,
        tokens=[5, 6, 7],
        response_length=1,
        loss_mask=[1],
        rollout_log_probs=[-0.5],
        status=Status.COMPLETED,
        multimodal_inputs={"images": ["a.png"]},
        multimodal_train_inputs={"pixel_values": [[0.5]]},
        remove_sample=True,
        generate_function_path="mod:fn",
        non_generation_time=0.25,
    )
    s.spec_info.add(
        {"spec_accept_token_num": 6, "spec_draft_token_num": 8, "spec_verify_ct": 2, "completion_tokens": 9}
    )
    s.validate()
    d = json.loads(s.to_json())
    assert d["spec_info"] == {
        "spec_accept_token_num": 6,
        "spec_draft_token_num": 8,
        "spec_verify_ct": 2,
        "completion_token_num": 9,
    }
    back = Sample.from_dict(d)
    # the processed arrays are not written (the trainer processes the images again): everything else is
    assert d["multimodal_train_inputs"] is None and back.multimodal_inputs == {"images": ["a.png"]}
    back.multimodal_train_inputs = s.multimodal_train_inputs
    assert back == s and back.spec_info.spec_accept_rate == 0.75 and back.spec_info.spec_accept_length == 4.5


def test_a_slime_dump_reads_in_keeping_what_has_no_field_yet():
    """A line as slime's Sample.to_dict writes it: fields agentrl has not adopted are kept, not dropped."""
    row = {
        "group_index": 0,
        "index": 3,
        "prompt": "p",
        "tokens": [1, 2],
        "response_length": 1,
        "status": "truncated",
        "metadata": {},
        "remove_sample": False,
        "non_generation_time": 1.5,
        "spec_info": {"spec_accept_token_num": 1, "spec_draft_token_num": 2, "spec_verify_ct": 1},
        "prefix_cache_info": {"cached_tokens": 4, "total_prompt_tokens": 8},
        "session_id": "abc",
    }
    s = Sample.from_dict(row)
    assert s.status is Status.TRUNCATED and s.non_generation_time == 1.5 and s.spec_info.spec_accept_token_num == 1
    assert s.metadata["extra"] == {
        "prefix_cache_info": {"cached_tokens": 4, "total_prompt_tokens": 8},
        "session_id": "abc",
    }


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"remove_sample": 1}, "remove_sample must be True or False"),
        ({"non_generation_time": -1.0}, "non_generation_time must be a finite number"),
        ({"non_generation_time": float("nan")}, "non_generation_time must be a finite number"),
    ],
)
def test_validate_refuses_bad_control_fields(kw, message):
    with pytest.raises(ValueError, match=message):
        Sample(**kw).validate()


def test_speculative_counters_are_read_from_sglangs_meta_info():
    body = {
        "text": "hi",
        "output_ids": [4, 5],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 5},
            "output_token_logprobs": [[-0.1, 4, None], [-0.2, 5, None]],
            "completion_tokens": 2,
            "spec_verify_ct": 1,
            "spec_accept_token_num": 1,
            "spec_draft_token_num": 3,
        },
    }
    out = GenerateOutput.from_sglang(body)
    assert out.spec == {
        "spec_verify_ct": 1,
        "spec_accept_token_num": 1,
        "spec_draft_token_num": 3,
        "completion_tokens": 2,
    }
    del body["meta_info"]["spec_verify_ct"], body["meta_info"]["spec_accept_token_num"]
    del body["meta_info"]["spec_draft_token_num"]
    assert GenerateOutput.from_sglang(body).spec is None  # no speculative decoding: nothing to add up
    body["meta_info"]["spec_verify_ct"] = "2"
    with pytest.raises(EngineError, match=r"meta_info.spec_verify_ct='2' is not a count"):
        GenerateOutput.from_sglang(body)


@pytest.mark.parametrize(
    "value, message",
    [
        ([1, 2], "spec_info must be an object of counts"),
        ({"spec_verify_ct": 2.9}, r"spec_info.spec_verify_ct must be an integer count >= 0, not 2.9"),
        ({"spec_verify_ct": True}, "spec_info.spec_verify_ct must be an integer count"),
        ({"spec_verify_ct": -1}, "spec_info.spec_verify_ct must be an integer count"),
        ({"accepted": 1}, r"spec_info has unknown keys \['accepted'\]"),
    ],
)
def test_a_bad_spec_info_is_refused_naming_it(value, message):
    with pytest.raises(ValueError, match=message):
        Sample.from_dict({"spec_info": value})


def test_validate_refuses_bad_typed_fields():
    with pytest.raises(ValueError, match="generate_function_path must be a module:fn string"):
        Sample(generate_function_path=5).validate()
    with pytest.raises(ValueError, match="multimodal_inputs must be a dict or None, not list"):
        Sample(multimodal_inputs=[1]).validate()


class SlowEnv(agentrl.Env):
    """Two turns; reset and every step sleep, as an env whose tools run for a while."""

    max_turns = 2

    async def reset(self, *, seed=None, options=None):
        await asyncio.sleep(0.05)
        return [{"role": "user", "content": "go"}], {}

    async def step(self, action):
        await asyncio.sleep(0.1)
        return [{"role": "user", "content": "again"}], 0.5, False, False, {}


class SpeculativeEngine(Engine):
    """A fake of SGLang decoding with a draft model (which needs a GPU): fixed replies carrying the
    speculative counters SGLang puts in ``meta_info``."""

    def __init__(self, eos: int):
        self.eos = eos

    async def generate(self, input_ids, sampling_params, *, key=None):
        await asyncio.sleep(0.3)  # engine time, which non_generation_time must not count
        ids = [7, 8, self.eos]
        spec = {"spec_verify_ct": 2, "spec_accept_token_num": 3, "spec_draft_token_num": 4, "completion_tokens": 3}
        return GenerateOutput(ids, [-0.1] * 3, "stop", self.eos, spec=spec)

    async def health(self):
        return True


async def test_an_episode_sums_spec_counters_and_times_the_env(tiny_tokenizer):
    ctx = EpisodeContext(
        engine=SpeculativeEngine(tiny_tokenizer.eos_token_id),
        template=ChatTemplate(tiny_tokenizer),
        config=RolloutConfig(max_turns=2),
    )
    (s,), _ = await generate_rollout(ctx, SlowEnv, [{"prompt": "x"}])
    assert s.status == Status.TRUNCATED and s.status_reason == "max_turns", s.metadata
    assert s.spec_info == Sample.SpecInfo(6, 8, 4, 6)
    assert 0.25 <= s.non_generation_time < 0.6  # reset 0.05 + two steps of 0.1, not the engine's 2 x 0.3


class NoEngine(Engine):
    """Nothing to serve: the generate functions below never ask an engine."""

    async def generate(self, input_ids, sampling_params, *, key=None):
        raise EngineError("not used")

    async def health(self):
        return True


async def test_a_rows_generate_function_path_wins_over_the_runs(tiny_tokenizer, tmp_path, monkeypatch):
    (tmp_path / "row_gen.py").write_text(
        "async def special(args, sample, sampling_params):\n"
        "    sample.tokens, sample.response_length, sample.loss_mask, sample.rollout_log_probs = [1, 2], 1, [1], [-1.0]\n"
        "    sample.reward = 2.0\n"
        "    return sample\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "row_gen", raising=False)

    async def default(args, sample, sampling_params):
        sample.tokens, sample.response_length, sample.loss_mask, sample.rollout_log_probs = [1, 2], 1, [1], [-1.0]
        sample.reward = 1.0
        return sample

    trusted = RolloutConfig(trust_row_code=True)  # rows name code to run only with --trust-row-code
    ctx = EpisodeContext(engine=NoEngine(), template=ChatTemplate(tiny_tokenizer), config=trusted)
    own = task_from_row({"prompt": "a", "generate_function_path": "row_gen:special"}, trust_row_code=True)
    rows = [own, task_from_row({"prompt": "b"})]
    samples, _ = await generate_rollout(ctx, None, rows, custom_generate=default)
    assert [(s.reward, s.generate_function_path) for s in samples] == [(2.0, "row_gen:special"), (1.0, None)]
    assert "generate_function_path" not in samples[0].metadata
    # without a run-wide function or env, every row must name its own
    with pytest.raises(ValueError, match="need an env"):
        await generate_rollout(ctx, None, rows)
    with pytest.raises(ValueError, match=r"row 3: 'generate_function_path' 'row_gen:missing'"):
        task_from_row({"prompt": "c", "generate_function_path": "row_gen:missing"}, where="row 3", trust_row_code=True)
    with pytest.raises(ValueError, match="must be a module:fn string"):
        task_from_row({"prompt": "c", "generate_function_path": 5}, trust_row_code=True)
    (tmp_path / "row_sync.py").write_text("def gen(args, sample, sampling_params):\n    return sample\n")
    with pytest.raises(ValueError, match="'row_sync:gen' must be an async def generate"):
        task_from_row({"prompt": "c", "generate_function_path": "row_sync:gen"}, trust_row_code=True)
    (tmp_path / "row_broken.py").write_text("def gen(:\n")
    with pytest.raises(ValueError, match="'row_broken:gen'.*SyntaxError"):
        task_from_row({"prompt": "c", "generate_function_path": "row_broken:gen"}, trust_row_code=True)


async def test_a_reward_function_that_breaks_a_field_fails_its_sample(tiny_tokenizer):
    async def generate(args, sample, sampling_params):
        sample.tokens, sample.response_length, sample.loss_mask, sample.rollout_log_probs = [1, 2], 1, [1], [-1.0]
        return sample

    def reward(args, sample):
        sample.remove_sample = "yes" if sample.index == 0 else True
        return 1.0

    ctx = EpisodeContext(engine=NoEngine(), template=ChatTemplate(tiny_tokenizer), config=RolloutConfig())
    samples, _ = await generate_rollout(
        ctx, None, [{"prompt": "a"}, {"prompt": "b"}], custom_generate=generate, custom_reward=reward
    )
    assert [s.status_reason for s in samples] == ["reward_error", "custom_generate"]
    assert "remove_sample must be True or False" in samples[0].metadata["error"] and samples[1].remove_sample


def test_step_metrics_report_the_new_fields():
    from agentrl.metrics import step_metrics

    a = Sample(status=Status.COMPLETED, reward=1.0, non_generation_time=0.5, remove_sample=True)
    b = Sample(status=Status.COMPLETED, reward=0.0, non_generation_time=1.5)
    a.spec_info.add(
        {"spec_accept_token_num": 3, "spec_draft_token_num": 4, "spec_verify_ct": 2, "completion_tokens": 5}
    )
    b.spec_info.add(
        {"spec_accept_token_num": 1, "spec_draft_token_num": 4, "spec_verify_ct": 1, "completion_tokens": 1}
    )
    m = step_metrics([a, b], rollout_seconds=1.0)
    assert m["non_generation_time_mean"] == 1.0 and m["count_remove_sample"] == 1
    assert m["spec_accept_rate"] == 0.5 and m["spec_accept_length"] == 2.0
    assert "spec_accept_rate" not in step_metrics([Sample(status=Status.COMPLETED)], rollout_seconds=1.0)


def test_the_viewer_shows_the_control_fields(tiny_tokenizer):
    from agentrl.view import render_html

    s = Sample(index=0, tokens=[5, 6], response_length=1, loss_mask=[1], remove_sample=True)
    s.generate_function_path = "my_mod:<gen>"
    html = render_html([s, Sample(index=1, tokens=[5, 6], response_length=1, loss_mask=[1])], tiny_tokenizer)
    assert html.count("trains no token") == 1 and "my_mod:<gen>" not in html  # shown, escaped by the page
    assert "generate_function_path" in html


def test_sft_refuses_the_rl_only_hooks():
    with pytest.raises(ValueError, match="--rollout-sample-filter-path is for RL rollouts"):
        RunConfig(
            env="agentrl.envs.digits:Digits",
            sft_data="x.jsonl",
            rollout_sample_filter_path="m:f",
            train=TrainConfig(loss_type="sft_loss"),
        ).validate()


def test_a_sample_filter_must_work_in_place():
    samples = [[Sample(index=i) for i in range(2)]]

    def loop(fn) -> EpisodeCollector:
        return EpisodeCollector(RunConfig(), ctx=None, env_factory=None, source=None, sample_filter=fn)

    def drop_first(args, groups):
        groups[0][0].remove_sample = True

    with pytest.raises(TypeError, match="added or dropped samples"):
        loop(lambda args, groups: groups[0].clear()).filter_samples([[Sample(index=0), Sample(index=1)]])

    loop(drop_first).filter_samples(samples)
    assert [s.remove_sample for s in samples[0]] == [True, False]
    with pytest.raises(TypeError, match="return None, not list"):
        loop(lambda args, groups: groups).filter_samples(samples)
    with pytest.raises(TypeError, match="sample 1: remove_sample='yes' is not True or False"):
        loop(lambda args, groups: setattr(groups[0][1], "remove_sample", "yes")).filter_samples(samples)
    samples[0][1].remove_sample = None  # set by another hook: refused without a filter too
    with pytest.raises(TypeError, match="remove_sample=None"):
        loop(None).filter_samples(samples)
    samples[0][1].remove_sample = False
    with pytest.raises(RuntimeError, match="--rollout-sample-filter-path raised KeyError"):
        loop(lambda args, groups: {}["x"]).filter_samples(samples)


async def test_a_batch_rollout_function_gets_every_sample_in_one_call(tiny_tokenizer, tmp_path, monkeypatch):
    """slime's ``--rollout-function-path`` signature: async fn(args, samples, evaluation) -> samples."""
    from agentrl.rollout.generate import BatchGenerate

    calls = []

    async def batch(args, samples, evaluation=False):
        calls.append(([(s.group_index, s.index, s.prompt) for s in samples], evaluation))
        for s in samples:
            s.tokens, s.response_length, s.loss_mask, s.rollout_log_probs = [1, 2], 1, [1], [-1.0]
            s.reward = float(s.index)
        return list(reversed(samples))  # any order, the same samples

    (tmp_path / "row_gen2.py").write_text(
        "async def own(args, sample, sampling_params):\n"
        "    sample.tokens, sample.response_length, sample.loss_mask, sample.rollout_log_probs = [1, 2], 1, [1], [-1.0]\n"
        "    sample.reward = -1.0\n"
        "    return sample\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = RolloutConfig(n_samples_per_prompt=2, trust_row_code=True)
    ctx = EpisodeContext(engine=NoEngine(), template=ChatTemplate(tiny_tokenizer), config=cfg)
    own = task_from_row({"prompt": "b", "generate_function_path": "row_gen2:own"}, trust_row_code=True)
    rows = [{"prompt": "a"}, own, {"prompt": "c"}]
    samples, _ = await generate_rollout(ctx, None, rows, custom_generate=BatchGenerate(batch))
    assert calls == [([(0, 0, "a"), (0, 1, "a"), (2, 4, "c"), (2, 5, "c")], False)]  # one call; row b ran its own
    assert [s.reward for s in samples] == [0.0, 1.0, -1.0, -1.0, 4.0, 5.0]
    assert [s.status_reason for s in samples[:2]] == ["rollout_function", "rollout_function"]

    async def drops_one(args, samples, evaluation=False):
        return samples[:-1]

    async def exits(args, samples, evaluation=False):
        raise SystemExit(3)

    for fn, message in ((drops_one, "none added, dropped, repeated or moved"), (exits, "SystemExit")):
        samples, _ = await generate_rollout(ctx, None, rows[:1], custom_generate=BatchGenerate(fn, evaluation=True))
        assert [s.status for s in samples] == [Status.FAILED, Status.FAILED]  # the samples fail, not the run
        assert all(s.status_reason == "rollout_function_error" and message in s.metadata["error"] for s in samples)


async def test_a_custom_samples_group_and_task_are_written_once(tiny_tokenizer):
    """``group_base`` numbers the groups (the train loop's unique ids) where the samples are made; the row is
    ``metadata["task"]``, kept on a new object a batch function builds."""
    from agentrl.rollout.generate import BatchGenerate

    async def rebuild(args, samples, evaluation=False):  # new Samples, built without the given metadata
        return [
            Sample(group_index=s.group_index, index=s.index, prompt=s.prompt, tokens=[1, 2], response_length=1,
                   loss_mask=[1], rollout_log_probs=[-1.0])
            for s in samples
        ]  # fmt: skip

    async def replace_metadata(args, samples, evaluation=False):  # the same objects, their metadata replaced
        for s in samples:
            s.tokens, s.response_length, s.loss_mask, s.rollout_log_probs = [1, 2], 1, [1], [-1.0]
            s.metadata = {"mine": 1}
        return samples

    seen = []

    async def one_new(args, sample, sampling_params):  # per sample: sees the row's columns, returns a new object
        seen.append(sample.metadata.get("task"))
        return Sample(group_index=sample.group_index, index=sample.index, prompt=sample.prompt, tokens=[1, 2],
                      response_length=1, loss_mask=[1], rollout_log_probs=[-1.0], metadata={"task": "mine"})  # fmt: skip

    ctx = EpisodeContext(
        engine=NoEngine(), template=ChatTemplate(tiny_tokenizer), config=RolloutConfig(n_samples_per_prompt=2)
    )
    rows = [{"prompt": "a", "kind": 1}, {"prompt": "b", "label": "2", "task": "gsm8k"}]  # a column named task
    for fn in (BatchGenerate(rebuild), BatchGenerate(replace_metadata), one_new):
        samples, _ = await generate_rollout(ctx, None, rows, custom_generate=fn, group_base=3_000)
        assert [(s.group_index, s.index) for s in samples] == [(3000, 0), (3000, 1), (3001, 2), (3001, 3)]
        assert [s.metadata["task"] for s in samples] == [rows[0], rows[0], rows[1], rows[1]], fn
        assert {s.status for s in samples} == {Status.COMPLETED}, [s.metadata.get("error") for s in samples]
    assert sorted(seen, key=str) == [
        None,
        None,
        "gsm8k",
        "gsm8k",
    ]  # during generation: the row's own columns, as in slime


async def test_a_rollout_function_may_not_move_samples_between_groups(tiny_tokenizer):
    from agentrl.rollout.generate import BatchGenerate

    async def regroup(args, samples, evaluation=False):
        for s in samples:
            s.tokens, s.response_length, s.loss_mask, s.rollout_log_probs = [1, 2], 1, [1], [-1.0]
            s.group_index = 7  # would merge groups (or index past the run's rows)
        return samples

    ctx = EpisodeContext(
        engine=NoEngine(), template=ChatTemplate(tiny_tokenizer), config=RolloutConfig(n_samples_per_prompt=2)
    )
    samples, _ = await generate_rollout(ctx, None, [{"prompt": "a"}], custom_generate=BatchGenerate(regroup))
    assert [s.status for s in samples] == [Status.FAILED, Status.FAILED]
    assert "in their groups" in samples[0].metadata["error"]

    async def moves_one(args, sample, sampling_params):
        sample.tokens, sample.response_length, sample.loss_mask, sample.rollout_log_probs = [1, 2], 1, [1], [-1.0]
        sample.group_index = 3
        return sample

    samples, _ = await generate_rollout(ctx, None, [{"prompt": "a"}], custom_generate=moves_one)
    assert all(s.status == Status.FAILED and "groups are the run's" in s.metadata["error"] for s in samples)


def test_a_rollout_function_with_slimes_other_signature_is_refused_at_load(tmp_path):
    from agentrl.rollout.generate import BatchGenerate

    (tmp_path / "fns.py").write_text(
        "def generate_rollout(args, rollout_id, data_source, evaluation=False):\n    return []\n"
        "async def two_args(args, samples):\n    return samples\n"
        "async def good(args, samples, evaluation=False):\n    return samples\n"
    )
    for name in ("generate_rollout", "two_args"):
        with pytest.raises(TypeError, match="must be `async def fn\\(args, samples, evaluation=False\\)"):
            BatchGenerate.load(f"{tmp_path}/fns.py:{name}")
    assert BatchGenerate.load(f"{tmp_path}/fns.py:good").evaluation is False


async def test_eval_runs_the_rollout_function_told_it_evaluates(tiny_tokenizer):
    from agentrl.rollout.eval import evaluate
    from agentrl.rollout.generate import BatchGenerate

    seen = []

    async def batch(args, samples, evaluation=False):
        seen.append(evaluation)
        for s in samples:
            s.tokens, s.response_length, s.loss_mask, s.rollout_log_probs = [1, 2], 1, [1], [-1.0]
            s.reward = 1.0
        return samples

    ctx = EpisodeContext(engine=NoEngine(), template=ChatTemplate(tiny_tokenizer), config=RolloutConfig())
    out = await evaluate(
        ctx, None, {"set": [{"prompt": "a"}]}, n_samples=2, custom_generate=BatchGenerate(batch, evaluation=True)
    )
    assert seen == [True] and out["set"]["reward_mean"] == 1.0


# ---------------------------------------------------------------- rollout_routed_experts (MoE routing)


def _b64(ids: list[int]) -> str:
    import base64

    import numpy as np

    return base64.b64encode(np.asarray(ids, dtype=np.int32).tobytes()).decode("ascii")


def test_routed_experts_are_read_from_sglangs_meta_info():
    """SGLang's ``meta_info.routed_experts``: base64 int32 bytes, (prompt + reply - 1) tokens x layers x top-k."""
    body = {
        "output_ids": [4, 5],
        "meta_info": {
            "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[-0.1, 4, None], [-0.2, 5, None]],
            "prompt_tokens": 3,
            "routed_experts": _b64(list(range(4 * 2 * 2))),  # 3 + 2 - 1 = 4 forwarded tokens, 2 layers, top-2
        },
    }
    out = GenerateOutput.from_sglang(body)
    assert out.routed_experts.dtype == "int32" and out.routed_experts.tolist() == list(range(16))
    body["meta_info"]["routed_experts"] = _b64(list(range(15)))  # not a whole number of ids per token
    with pytest.raises(EngineError, match="holds 15 ids for 4 forwarded tokens"):
        GenerateOutput.from_sglang(body)
    body["meta_info"]["routed_experts"] = "not base64!"
    with pytest.raises(EngineError, match="malformed"):
        GenerateOutput.from_sglang(body)
    del body["meta_info"]["routed_experts"]
    assert GenerateOutput.from_sglang(body).routed_experts is None


class MoEEngine(Engine):
    """A fake of SGLang serving an MoE model with ``--enable-return-routed-experts`` (which needs a GPU):
    fixed replies whose routed experts cover every forwarded token, 3 layers x top-2, id = position % 8."""

    def __init__(self, eos: int):
        self.eos = eos

    async def generate(self, input_ids, sampling_params, *, key=None):
        import numpy as np

        ids = [7, 8, self.eos]
        forwarded = len(input_ids) + len(ids) - 1
        routed = (np.arange(forwarded * 6, dtype=np.int32) // 6) % 8
        return GenerateOutput(ids, [-0.1] * 3, "stop", self.eos, prompt_tokens=len(input_ids), routed_experts=routed)

    async def health(self):
        return True


async def test_an_episode_keeps_the_last_turns_routing_and_dumps_round_trip_it(tiny_tokenizer):
    ctx = EpisodeContext(
        engine=MoEEngine(tiny_tokenizer.eos_token_id),
        template=ChatTemplate(tiny_tokenizer),
        config=RolloutConfig(max_turns=2),
    )
    (s,), _ = await generate_rollout(ctx, SlowEnv, [{"prompt": "x"}])
    routed = s.rollout_routed_experts
    # the second turn's reply covered the whole episode up to its last sampled token (no observation after it)
    assert routed.shape == (len(s.tokens) - 1, 6) and routed.dtype == "int32"
    assert routed[:, 0].tolist() == [i % 8 for i in range(len(s.tokens) - 1)]
    s.validate()
    back = Sample.from_dict(json.loads(s.to_json()))
    assert back.rollout_routed_experts.tolist() == routed.tolist()
    with pytest.raises(ValueError, match="rollout_routed_experts is not an encoded int32 array"):
        Sample.from_dict({"rollout_routed_experts": {"dtype": "int64", "shape": [1], "base64": ""}})
    with pytest.raises(ValueError, match="rollout_routed_experts must be an int32 numpy array"):
        Sample(rollout_routed_experts=[[1]]).validate()
    import numpy as np

    slime_shape = np.zeros((len(s.tokens) - 1, 3, 2), dtype=np.int32)  # what slime's generate functions store
    Sample(rollout_routed_experts=slime_shape).validate()
    assert (
        Sample.from_dict(json.loads(Sample(rollout_routed_experts=slime_shape).to_json())).rollout_routed_experts.shape
        == slime_shape.shape
    )
    with pytest.raises(ValueError, match="dtype int64"):
        Sample(rollout_routed_experts=slime_shape.astype(np.int64)).validate()
    with pytest.raises(ValueError, match="is not a list of sizes"):
        Sample.from_dict({"rollout_routed_experts": {"dtype": "int32", "shape": [-1], "base64": ""}})


def test_routed_experts_flags_are_refused_where_they_cannot_work(capsys):
    from agentrl.cli import main

    base = ["train", "--env", "agentrl.envs.digits:Digits"]
    assert main([*base, "--rollout-return-routed-experts"]) == 2
    assert "the embedded engine serves dense models" in capsys.readouterr().err
    sglang = [*base, "--rollout-backend", "sglang", "--rollout-return-routed-experts"]
    assert main([*sglang, "--sglang-launcher", "agentrl"]) == 2  # checked before Ray, not after the servers start
    assert "the servers would be agentrl serve" in capsys.readouterr().err
    assert main([*base, "--train-backend", "megatron", "--use-rollout-routing-replay"]) == 2
    assert "routing replay in training" in capsys.readouterr().err


def test_a_reply_without_the_routed_experts_asked_for_is_malformed():
    from agentrl.engines.http import SGLangEngine

    body = {
        "output_ids": [4],
        "meta_info": {
            "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[-0.1, 4, None]],
            "prompt_tokens": 2,
        },
    }
    assert SGLangEngine("http://127.0.0.1:9")._parse_generate(body).routed_experts is None  # not asked for
    with pytest.raises(EngineError, match="asked for return_routed_experts"):
        SGLangEngine("http://127.0.0.1:9", return_routed_experts=True)._parse_generate(body)


@pytest.mark.e2e
async def test_the_embedded_server_refuses_routed_experts_naming_them(tiny_server):
    """It serves dense models: server_info says so (the run's start-up check reads it) and a request is a 400."""
    from agentrl.engines.base import SamplingParams
    from agentrl.engines.http import EngineRequestError, SGLangEngine
    from agentrl.engines.router import Router
    from agentrl.runtime.train import _check_routed_experts

    engine = SGLangEngine(tiny_server, return_routed_experts=True)
    try:
        assert (await engine.server_info())["enable_return_routed_experts"] is False
        with pytest.raises(EngineRequestError, match="return_routed_experts=True is not supported"):
            await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
    finally:
        await engine.close()
    with pytest.raises(ValueError, match="start SGLang with --enable-return-routed-experts"):
        await asyncio.to_thread(_check_routed_experts, Router([SGLangEngine(tiny_server, return_routed_experts=True)]))


# ---------------------------------------------------------------- --apply-chat-template


async def test_apply_chat_template_renders_the_prompt_custom_functions_receive(tiny_tokenizer):
    """Raw by default (slime); with the flag the chat template's text, tools and generation prompt included,
    for the per-sample and the batch functions alike; a row that cannot be rendered fails its samples only."""
    from agentrl.rollout.generate import BatchGenerate

    seen: dict[str, list] = {"one": [], "batch": []}

    async def one(args, sample, sampling_params):
        seen["one"].append(sample.prompt)
        sample.tokens, sample.response_length, sample.loss_mask, sample.rollout_log_probs = [1, 2], 1, [1], [-1.0]
        return sample

    async def batch(args, samples, evaluation=False):
        for s in samples:
            await one(args, s, {})
            seen["batch"].append(seen["one"].pop())
        return samples

    tools = [{"type": "function", "function": {"name": "calc", "description": "math", "parameters": {}}}]
    rows = [{"prompt": "What is 2+2?"}, {"prompt": [{"role": "user", "content": "hi"}], "tools": tools}]
    template = ChatTemplate(tiny_tokenizer)
    for flag in (False, True):
        ctx = EpisodeContext(engine=NoEngine(), template=template, config=RolloutConfig(apply_chat_template=flag))
        await generate_rollout(ctx, None, rows, custom_generate=one)
        await generate_rollout(ctx, None, rows, custom_generate=BatchGenerate(batch))
        if not flag:
            assert seen["one"] == seen["batch"] == ["What is 2+2?", [{"role": "user", "content": "hi"}]]
        else:
            want = [
                template.render([{"role": "user", "content": "What is 2+2?"}], None, add_generation_prompt=True),
                template.render([{"role": "user", "content": "hi"}], tools, add_generation_prompt=True),
            ]
            assert seen["one"] == seen["batch"] == want
            assert "What is 2+2?" in want[0] and "calc" in want[1] and want[0] != "What is 2+2?"
        seen = {"one": [], "batch": []}
    ctx = EpisodeContext(engine=NoEngine(), template=template, config=RolloutConfig(apply_chat_template=True))
    bad = [{"prompt": 5}, {"prompt": "fine"}]
    for fn in (one, BatchGenerate(batch)):
        samples, _ = await generate_rollout(ctx, None, bad, custom_generate=fn)
        assert [s.status for s in samples] == [Status.FAILED, Status.COMPLETED]
        assert "string or a list of messages" in samples[0].metadata["error"]


def test_apply_chat_template_without_a_custom_function_is_refused(capsys, tmp_path):
    from agentrl.cli import main
    from agentrl.rollout.generate import check_apply_chat_template

    for cmd in ("train", "rollout"):
        assert main([cmd, "--env", "agentrl.envs.digits:Digits", "--apply-chat-template"]) == 2
        assert "--apply-chat-template renders the prompt a custom generate function receives" in capsys.readouterr().err
    rows = tmp_path / "r.jsonl"
    rows.write_text('{"prompt": "x"}\n')
    assert (
        main(
            [
                "eval",
                "--env",
                "agentrl.envs.digits:Digits",
                "--eval-prompt-data",
                "d",
                str(rows),
                "--apply-chat-template",
            ]
        )
        == 2
    )
    assert "--apply-chat-template renders the prompt a custom generate function receives" in capsys.readouterr().err
    assert main(["sft", "--sft-data", str(rows), "--apply-chat-template"]) == 2
    assert "not for --loss-type sft_loss" in capsys.readouterr().err
    on = RolloutConfig(apply_chat_template=True)
    check_apply_chat_template(on, custom=False, rows=[{"prompt": "x", "generate_function_path": "m:f"}])  # rows' own
    check_apply_chat_template(on, custom=True, rows=[{"prompt": "x"}])
    check_apply_chat_template(RolloutConfig(), custom=False, rows=[{"prompt": "x"}])


async def test_a_custom_generate_function_with_a_reward_function_at_concurrency_one(tiny_tokenizer):
    """The reward function runs after the episode gives its concurrency slot back (no self-deadlock)."""

    async def generate(args, sample, sampling_params):
        sample.tokens, sample.response_length, sample.loss_mask, sample.rollout_log_probs = [1, 2], 1, [1], [-1.0]
        return sample

    ctx = EpisodeContext(
        engine=NoEngine(), template=ChatTemplate(tiny_tokenizer), config=RolloutConfig(rollout_concurrency=1)
    )
    samples, _ = await asyncio.wait_for(
        generate_rollout(
            ctx, None, [{"prompt": "a"}, {"prompt": "b"}], custom_generate=generate, custom_reward=lambda args, s: 2.0
        ),
        timeout=30,
    )
    assert [s.reward for s in samples] == [2.0, 2.0]
