"""Sample's typed contract attributes (turn_rewards, turn_spans, env_spans, status_reason): one copy, in metadata."""

from __future__ import annotations

import json

import pytest

from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig
from agentrl.engines.base import Engine, EngineError
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.types import CONTRACT_FIELDS, Sample, Status


def _sample(**meta) -> Sample:
    return Sample(
        group_index=0,
        index=1,
        prompt="p",
        tokens=[1, 2, 3, 4, 5, 6],
        response_length=4,
        loss_mask=[1, 1, 0, 1],
        rollout_log_probs=[-0.1, -0.2, 0.0, -0.3],
        status=Status.COMPLETED,
        metadata={"num_turns": 2, **meta},
    )


def test_typed_attributes_and_metadata_are_one_copy():
    s = _sample()
    assert s.turn_rewards == [] and s.turn_spans == [] and s.env_spans == [] and s.status_reason == ""
    s.turn_rewards.append(1)  # the list itself: the loop appends a turn's reward
    s.turn_spans = [[0, 2], (3, 4)]
    s.env_spans = [(2, 3)]
    s.status_reason = "terminated"
    s.validate()
    assert s.metadata["turn_rewards"] == [1] and s.metadata["turn_spans"] == [(0, 2), (3, 4)]
    assert s.metadata["status_reason"] == "terminated"
    # the wire form is the one every dump has had: inside metadata, no new top-level keys
    d = json.loads(s.to_json())
    assert not set(CONTRACT_FIELDS) & set(d)
    assert d["metadata"] == {
        "num_turns": 2,
        "turn_rewards": [1],
        "turn_spans": [[0, 2], [3, 4]],
        "env_spans": [[2, 3]],
        "status_reason": "terminated",
    }
    back = Sample.from_dict(d)
    assert back.turn_spans == [(0, 2), (3, 4)] and back.env_spans == [(2, 3)] and back.turn_rewards == [1]
    assert back.status_reason == "terminated" and back.status is Status.COMPLETED
    assert json.loads(back.to_json()) == d


def test_slime_style_metadata_is_read_by_the_typed_attributes():
    s = _sample(turn_rewards=[0.5], turn_spans=[[0, 4]], status_reason="max_turns")
    assert s.turn_rewards == [0.5] and s.turn_spans == [(0, 4)] and s.status_reason == "max_turns"


@pytest.mark.parametrize(
    "meta, message",
    [
        ({"turn_spans": [(3, 9)]}, r"turn_spans entry \(3, 9\) is not a \(start, end\) inside 0..4"),
        ({"env_spans": [(2, 1)]}, "env_spans entry"),
        ({"turn_spans": [[5]]}, r"turn_spans entry \[5\]"),
        ({"turn_spans": "0-4"}, r"metadata\['turn_spans'\] must be a list"),
        ({"turn_rewards": ["1.0"]}, "turn_rewards must be a list of numbers"),
    ],
)
def test_validate_refuses_a_bad_record_naming_it(meta, message):
    with pytest.raises(ValueError, match=message):
        _sample(**meta).validate()


class NoEngine(Engine):
    """Nothing to serve: the custom generate functions below never ask an engine."""

    async def generate(self, input_ids, sampling_params, *, key=None):
        raise EngineError("not used")

    async def health(self) -> bool:
        return True


async def test_a_slime_style_custom_generate_function_keeps_its_record(tiny_tokenizer):
    async def generate(args, sample, sampling_params):
        sample.tokens, sample.response_length = [1, 2, 3], 2
        sample.loss_mask, sample.rollout_log_probs = [1, 1], [-0.5, -0.5]
        sample.metadata["turn_rewards"] = [0.25, 0.75]
        sample.metadata["turn_spans"] = [[0, 1], [1, 2]]
        if sample.index == 0:
            sample.metadata["status_reason"] = "my_reason"
        sample.reward = 1.0
        return sample

    ctx = EpisodeContext(engine=NoEngine(), template=ChatTemplate(tiny_tokenizer), config=RolloutConfig())
    samples, summary = await generate_rollout(ctx, None, [{"prompt": "a"}, {"prompt": "b"}], custom_generate=generate)
    assert [s.status_reason for s in samples] == ["my_reason", "custom_generate"]
    assert all(s.turn_rewards == [0.25, 0.75] and s.turn_spans == [(0, 1), (1, 2)] for s in samples)
    assert summary.reasons == {"my_reason": 1, "custom_generate": 1}


def test_episode_identity_is_typed_and_one_copy_with_its_metadata_keys():
    """``episode_id``, ``role``, ``segment`` and ``trained`` read and write the keys every dump has had."""
    alone = _sample()
    assert (alone.episode_id, alone.role, alone.segment, alone.trained) == (None, None, 0, True)
    s = _sample(episode_id="ep-1", role="x", segment=2, trained=False)
    assert (s.episode_id, s.role, s.segment, s.trained) == ("ep-1", "x", 2, False)
    s.role, s.segment, s.trained = "o", 3, True
    assert {k: s.metadata[k] for k in ("episode_id", "role", "segment", "trained")} == {
        "episode_id": "ep-1",
        "role": "o",
        "segment": 3,
        "trained": True,
    }
    back = Sample.from_dict(json.loads(s.to_json()))
    assert (back.episode_id, back.role, back.segment, back.trained) == ("ep-1", "o", 3, True)
    assert back.episode_key == s.episode_key == ("ep-1", "o")
    # how many segments the episode made: 1 and no key for a sample alone
    assert alone.num_segments == 1 and "num_segments" not in alone.metadata
    s.num_segments = 4
    assert Sample.from_dict(json.loads(s.to_json())).num_segments == 4 == s.metadata["num_segments"]
    # the policy a seat is played by: None (the run's) unless another policy played it; None writes no key
    assert alone.policy is None and "policy" not in alone.metadata
    s.policy = "http://127.0.0.1:9"
    assert Sample.from_dict(json.loads(s.to_json())).policy == "http://127.0.0.1:9" == s.metadata["policy"]
    s.policy = None
    assert "policy" not in s.metadata and s.policy is None
    # a seat's later segment (a history rewrite) keeps who played it
    from agentrl.rollout.episode import _next_segment

    s.policy = "http://127.0.0.1:9"
    nxt = _next_segment(s, [{"role": "user", "content": "again"}])
    assert (nxt.policy, nxt.role, nxt.trained, nxt.episode_id) == ("http://127.0.0.1:9", "o", True, "ep-1")


def test_episode_units_groups_segments_by_episode_and_seat_in_order():
    """The one grouping the loop, metrics, eval and demos use: one unit per (episode, seat), segments in order;
    a sample without an episode id (or with an empty one) is a unit of its own."""
    from agentrl.types import episode_units

    a0, a1 = _sample(episode_id="a", segment=0), _sample(episode_id="a", segment=1)
    ax, ao = _sample(episode_id="b", role="x"), _sample(episode_id="b", role="o")
    lone1, lone2, empty = _sample(), _sample(), _sample(episode_id="")
    units = episode_units([a0, lone1, ax, a1, ao, lone2, empty])
    assert units == [[a0, a1], [lone1], [ax], [ao], [lone2], [empty]]
    assert [len(u) for u in units] == [2, 1, 1, 1, 1, 1]
    assert units[0][0] is a0 and units[0][1] is a1 and units[1][0] is lone1 and units[4][0] is lone2
