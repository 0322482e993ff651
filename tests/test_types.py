"""Sample's typed contract fields (turn_rewards, turn_spans, env_spans, status_reason) and their wire form."""

from __future__ import annotations

import json

import pytest

from agentrl.types import CONTRACT_FIELDS, Sample, Status


def _sample(**kw) -> Sample:
    return Sample(
        group_index=0,
        index=1,
        prompt="p",
        tokens=[1, 2, 3, 4, 5, 6],
        response_length=4,
        loss_mask=[1, 1, 0, 1],
        rollout_log_probs=[-0.1, -0.2, 0.0, -0.3],
        status=Status.COMPLETED,
        metadata={"num_turns": 2},
        **kw,
    )


def test_contract_fields_travel_inside_metadata_and_come_back_typed():
    s = _sample(turn_rewards=[0.0, 1.0], turn_spans=[(0, 2), (3, 4)], env_spans=[(2, 3)], status_reason="terminated")
    s.validate()
    d = json.loads(s.to_json())
    assert not set(CONTRACT_FIELDS) & set(d)  # slime's top-level field set, nothing added
    assert d["metadata"] == {
        "num_turns": 2,
        "turn_rewards": [0.0, 1.0],
        "turn_spans": [[0, 2], [3, 4]],
        "env_spans": [[2, 3]],
        "status_reason": "terminated",
    }
    back = Sample.from_dict(d)
    assert back.turn_rewards == [0.0, 1.0] and back.turn_spans == [(0, 2), (3, 4)] and back.env_spans == [(2, 3)]
    assert back.status_reason == "terminated" and back.metadata == {"num_turns": 2} and back.status is Status.COMPLETED
    assert back.to_dict() == s.to_dict()


def test_a_sample_built_the_old_way_is_read_into_the_typed_fields_without_touching_the_callers_dict():
    meta = {"turn_rewards": [0.5], "turn_spans": [[0, 1]], "status_reason": "max_turns", "tool_calls": 1}
    s = Sample(tokens=[1, 2], response_length=1, metadata=meta)
    assert s.turn_rewards == [0.5] and s.turn_spans == [(0, 1)] and s.env_spans == []
    assert s.status_reason == "max_turns" and s.metadata == {"tool_calls": 1}
    assert meta == {"turn_rewards": [0.5], "turn_spans": [[0, 1]], "status_reason": "max_turns", "tool_calls": 1}


def test_validate_refuses_a_span_outside_the_response():
    with pytest.raises(ValueError, match=r"turn_spans entry \(3, 9\) is not a \(start, end\) inside 0..4"):
        _sample(turn_spans=[(3, 9)]).validate()
    with pytest.raises(ValueError, match="env_spans entry"):
        _sample(env_spans=[(2, 1)]).validate()
