"""Warm starts: demonstrations laid down token-exactly, every refusal, and `agentrl sft` end to end.

Real parts throughout: the tiny model's own tokenizer and the chat template the rollout uses, the
calculator env and its tool, the embedded engine over HTTP for rejection sampling, a local Ray
cluster with the trainer and engine actors for `agentrl sft`, safetensors checkpoints.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from agentrl.chat import ChatTemplate
from agentrl.cli import main
from agentrl.config import RolloutConfig, TrainConfig
from agentrl.envs.calculator import Calculator, random_policy, solver_policy
from agentrl.rollout.demos import DemoError, conversation_samples, rejection_samples, scripted_samples

TOOLS = Calculator().tool_schemas()
SYSTEM = {"role": "system", "content": Calculator.system_prompt}


def _call(expr: str, cid: str = "c1") -> dict:
    return {
        "id": cid,
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expr})},
    }


def _row(**over) -> dict:
    row = {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "What is 3 + 4 * 5?"},
            {"role": "assistant", "content": None, "tool_calls": [_call("3 + 4 * 5")]},
            {"role": "tool", "tool_call_id": "c1", "content": "23"},
            {"role": "assistant", "content": "The answer is 23."},
        ],
        "tools": TOOLS,
    }
    row.update(over)
    return row


@pytest.fixture(scope="module")
def template(tiny_tokenizer):
    return ChatTemplate(tiny_tokenizer)


def _spans(template, s) -> list[str]:
    resp = s.tokens[s.prompt_length :]
    return [template.decode(resp[a:b]) for a, b in s.turn_spans]


def test_json_string_arguments_are_taught_as_objects():
    from agentrl.rollout.demos import check_conversation

    row = _row()
    msgs = check_conversation(row, "f.jsonl:1", {"calculator"})
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"expression": "3 + 4 * 5"}  # templates tojson it once
    assert isinstance(row["messages"][2]["tool_calls"][0]["function"]["arguments"], str)  # the row itself is untouched


def test_conversation_becomes_a_token_exact_sample(template):
    (s,), stats = conversation_samples([("f.jsonl:1", _row())], template, env_tools=TOOLS)
    assert s.token_exact and stats.kept == 1 and stats.assistant_turns == 2
    s.validate()
    # mask-1 spans are exactly the assistant turns in the wire format the hermes parser reads, stop token included
    first, second = _spans(template, s)
    assert (
        first
        == '\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4 * 5"}}\n</tool_call><|im_end|>'
    )
    assert second == "The answer is 23.<|im_end|>"
    assert [m for m in s.loss_mask if m] == [1] * sum(b - a for a, b in s.turn_spans)
    from agentrl.parsing import get_parser

    _, calls, errors = get_parser("hermes").parse(first.removesuffix("<|im_end|>"))
    assert not errors and calls[0].name == "calculator" and calls[0].arguments == {"expression": "3 + 4 * 5"}
    # the whole sample is the template's own rendering of the conversation (up to the final "\n")
    full = template.render(_row()["messages"], TOOLS, add_generation_prompt=False)
    assert template.decode(s.tokens) + "\n" == full
    assert template.decode(s.tokens[: s.prompt_length]) == template.render(
        _row()["messages"][:2], TOOLS, add_generation_prompt=True
    )


def test_scripted_demos_equal_the_rollout_ledger_and_earn_the_env_reward(template):
    tasks = Calculator.tasks(6)
    samples, stats = asyncio.run(scripted_samples(Calculator, solver_policy, tasks, template, min_reward=1.0))
    assert stats.kept == 6 and all(s.reward == 1.0 and s.token_exact for s in samples)
    spans = _spans(template, samples[0])
    assert spans[0].startswith("<tool_call>") and spans[1] == f"The answer is {tasks[0]['label']}.<|im_end|>"
    # a policy that guesses earns nothing: with --demo-min-reward 1 nothing of it is kept
    kept, stats = asyncio.run(scripted_samples(Calculator, random_policy(0), tasks, template, min_reward=1.0))
    assert kept == [] and stats.below_min_reward == 6


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "x"}, "f.jsonl:1: no 'messages' list"),
        (_row(messages=[{"role": "robot", "content": "hi"}]), "messages[0] has role 'robot'"),
        (_row(messages=[{"role": "user", "content": "hi"}]), "no assistant message"),
        (_row(messages=[{"role": "assistant", "content": "hi"}]), "starts with a system or user message"),
        (
            _row(messages=[{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]),
            "content must be a string",
        ),
        (
            _row(
                messages=[
                    {"role": "user", "content": "q"},
                    {"role": "tool", "content": "1"},
                    {"role": "assistant", "content": "a"},
                ]
            ),
            "messages[1]: a tool message with no unanswered tool call",
        ),
        (
            _row(
                messages=[
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": None, "tool_calls": [_call("1")]},
                    {"role": "tool", "tool_call_id": "zz", "content": "1"},
                    {"role": "assistant", "content": "a"},
                ]
            ),
            "tool_call_id 'zz' matches no call",
        ),
        (
            _row(
                messages=[
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c", "function": {"name": "shell", "arguments": "{}"}}],
                    },
                ]
            ),
            "calls tool 'shell', which is not offered",
        ),
        (
            _row(
                messages=[
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c", "function": {"name": "calculator", "arguments": "{oops"}}],
                    },
                ]
            ),
            "are not valid JSON",
        ),
        (_row(tools=[{"type": "function", "function": {"name": "search"}}]), "differ from the env's ['calculator']"),
    ],
)
def test_bad_demonstrations_are_refused_with_file_and_line(template, row, message):
    with pytest.raises(DemoError, match="1 demonstration\\(s\\) refused") as err:
        conversation_samples([("f.jsonl:1", row)], template, env_tools=TOOLS)
    assert message in str(err.value)


def test_every_bad_row_is_listed_and_nothing_is_kept(template):
    rows = [("f.jsonl:1", _row()), ("f.jsonl:2", {"messages": []}), ("f.jsonl:3", _row()), ("f.jsonl:4", {"x": 1})]
    with pytest.raises(DemoError) as err:
        conversation_samples(rows, template, env_tools=TOOLS)
    text = str(err.value)
    assert text.startswith("2 demonstration(s) refused") and "f.jsonl:2:" in text and "f.jsonl:4:" in text


LOOKAHEAD = (  # writes an assistant turn's calls only once their results follow: the turn changes after the fact
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% if m['tool_calls'] and not loop.last %}[calls]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_a_turn_after_the_fact_is_refused_at_the_first_differing_token(tiny_tokenizer):
    tpl = ChatTemplate(tiny_tokenizer, template=LOOKAHEAD, tool_template="native")
    row = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "one", "tool_calls": [_call("1")]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
            {"role": "assistant", "content": "two"},
        ],
        "tools": TOOLS,
    }
    with pytest.raises(
        DemoError,
        match=r"f.jsonl:7: the chat template does not reproduce this conversation turn by "
        r"turn: first difference at token \d+ of \d+: laid down '<\|im_end\|>.*whole "
        r"rendering '\[calls\]",
    ):
        conversation_samples([("f.jsonl:7", row)], tpl)
    (s,), stats = conversation_samples([("f.jsonl:7", row)], tpl, allow_non_token_exact=True)
    assert not s.token_exact and stats.not_token_exact == 1


def test_a_template_that_re_renders_history_is_refused_as_the_rollout_refuses_it(tiny_tokenizer):
    rewriting = LOOKAHEAD.replace(
        "{{ m['content'] or '' }}", "{{ (m['content'] if loop.last or m['role'] != 'assistant' else '...') or '' }}"
    )
    tpl = ChatTemplate(tiny_tokenizer, template=rewriting, tool_template="native")
    row = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "one"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "two"},
        ]
    }
    with pytest.raises(DemoError, match="f.jsonl:2: the chat template re-renders earlier turns"):
        conversation_samples([("f.jsonl:2", row)], tpl)


def test_rows_are_read_from_json_parquet_and_datasets_folders(tmp_path, template):
    from agentrl.data import read_rows

    rows = [_row(), _row()]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    got = list(read_rows(tmp_path / "d.json"))
    assert [w for w, _ in got] == [f"{tmp_path}/d.json[0]", f"{tmp_path}/d.json[1]"]
    (tmp_path / "bad.jsonl").write_text(json.dumps(_row()) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: expected a JSON object"):
        list(read_rows(tmp_path / "bad.jsonl"))
    (tmp_path / "x.txt").write_text("a")
    with pytest.raises(ValueError, match="x.txt:1: not valid JSON"):  # other names are JSON Lines
        list(read_rows(tmp_path / "x.txt"))
    import datasets  # a test dependency: Parquet and datasets folders must be exercised, not skipped

    # as Hugging Face datasets hold them: tools as JSON text, every message with every key (None where absent)
    ds = datasets.Dataset.from_list([{"messages": r["messages"], "tools": json.dumps(r["tools"])} for r in rows])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    for path in (tmp_path / "d.parquet", tmp_path / "folder"):
        samples, stats = conversation_samples(read_rows(path), template, env_tools=TOOLS)
        assert stats.kept == 2 and _spans(template, samples[0])[1] == "The answer is 23.<|im_end|>"
        assert samples[0].tokens == conversation_samples([("x", _row())], template, env_tools=TOOLS)[0][0].tokens


class _Scored(__import__("agentrl").Env):
    """One turn; the reward is the task's own ``score`` whatever the model wrote (sampling is not seeded)."""

    max_turns = 1

    async def reset(self, *, seed=None, options=None):
        self.score = float(options["score"])
        return [{"role": "user", "content": options["prompt"]}], {}

    async def step(self, action):
        return [], self.score, True, False, {}


def test_rejection_sampling_keeps_only_episodes_at_or_above_the_threshold(tiny_server, tiny_tokenizer):
    from agentrl.engines.http import SGLangEngine
    from agentrl.rollout.episode import EpisodeContext

    engine = SGLangEngine(tiny_server)
    cfg = RolloutConfig(n_samples_per_prompt=6, max_turns=1, rollout_max_turn_len=48, rollout_seed=3)
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tiny_tokenizer), config=cfg)
    tasks = [{"prompt": f"task {i}", "score": score} for i, score in enumerate((0.0, 0.5, 1.0, 0.2))]

    async def run(**kw):
        try:
            return await rejection_samples(ctx, _Scored, tasks, **kw)
        finally:
            await engine.close()

    kept, stats = asyncio.run(run(min_reward=0.5))
    assert stats.rows == 24 and stats.kept + stats.below_min_reward + stats.failed_episodes == 24
    assert stats.kept == len(kept) > 0 and stats.below_min_reward > 0
    assert {s.group_index for s in kept} <= {1, 2} and all(s.reward >= 0.5 and s.token_exact for s in kept)
    # a turn cut off by the length limit never becomes a demonstration; the others of groups 1 and 2 are kept
    assert all(s.status_reason == "terminated" for s in kept)
    assert stats.kept + stats.failed_episodes >= 12
    best, stats = asyncio.run(run(min_reward=0.0, best_of_n=True))
    assert sorted(s.group_index for s in best) == sorted({s.group_index for s in best}) and 0 < len(best) <= 4


def test_best_of_n_keeps_the_chosen_episode_whole(tiny_server, tiny_tokenizer):
    from agentrl.engines.http import SGLangEngine
    from agentrl.rollout.episode import EpisodeContext
    from tests.test_segments import SummarizingTalk

    engine = SGLangEngine(tiny_server)
    cfg = RolloutConfig(n_samples_per_prompt=3, max_turns=5, rollout_max_turn_len=200, rollout_seed=3)
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tiny_tokenizer), config=cfg)

    async def run():
        try:
            return await rejection_samples(
                ctx, SummarizingTalk, [{"prompt": "a"}, {"prompt": "b"}], min_reward=0.0, best_of_n=True
            )
        finally:
            await engine.close()

    kept, _ = asyncio.run(run())
    by_task: dict = {}
    for s in kept:  # every episode of SummarizingTalk is two segments: the chosen one comes whole
        by_task.setdefault(s.group_index, []).append(s)
    assert sorted(by_task) == [0, 1]
    for segs in by_task.values():
        assert len({s.metadata["episode_id"] for s in segs}) == 1 and [s.metadata["segment"] for s in segs] == [0, 1]


def test_sft_loss_is_the_masked_negative_log_likelihood():
    from agentrl.algo.loss import policy_loss

    logp = torch.log(torch.tensor([0.5, 0.25, 0.1, 0.9])).requires_grad_()
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    seq = torch.tensor([0, 0, 0, 1])
    cfg = TrainConfig(loss_type="sft_loss", calculate_per_token_loss=True)
    loss, m = policy_loss(logp, logp.detach(), torch.zeros(4), mask, seq, cfg, num_tokens=3, num_seqs=2)
    want = -(logp[0] + logp[1] + logp[3]) / 3
    assert torch.allclose(loss, want) and m["sft_loss"] == pytest.approx(float(want))
    loss.backward()
    assert logp.grad[2] == 0 and (logp.grad[[0, 1, 3]] < 0).all()  # descent raises the demonstrated tokens' log-probs
    per_seq = policy_loss(
        logp, logp, torch.zeros(4), mask, seq, TrainConfig(loss_type="sft_loss"), num_tokens=3, num_seqs=2
    )[0]
    assert torch.allclose(per_seq, -((logp[0] + logp[1]) / 2 + logp[3]) / 2)


def test_sft_flags_are_checked_before_any_work(tmp_path, capsys):
    assert main(["sft", "--env", "agentrl.envs.calculator:Calculator", "--save", str(tmp_path / "r")]) == 2
    assert (
        "pass exactly one of --sft-data FILE, --demo-policy MODULE:FN, --demo-engine-url URL" in capsys.readouterr().err
    )
    assert main(["train", "--env", "agentrl.envs.calculator:Calculator", "--sft-data", "x.jsonl"]) == 2
    assert "use `agentrl sft` (or --loss-type sft_loss)" in capsys.readouterr().err
    assert main(["sft", "--env", "agentrl.envs.calculator:Calculator", "--demo-engine-url", "http://127.0.0.1:1"]) == 2
    assert "needs --demo-min-reward" in capsys.readouterr().err
    assert main(["sft", "--sft-data", "x.jsonl", "--num-epoch", "2", "--num-rollout", "3"]) == 2
    assert "--num-epoch and --num-rollout both" in capsys.readouterr().err
    assert main(["sft", "--sft-data", "x.jsonl", "--prompt-data", "t.jsonl"]) == 2
    assert "--sft-data brings its own conversations" in capsys.readouterr().err
    assert main(["sft", "--sft-data", "x.jsonl", "--num-steps-per-rollout", "2"]) == 2
    assert "drop --num-steps-per-rollout" in capsys.readouterr().err
    assert main(["sft", "--sft-data", "x.jsonl", "--demo-min-reward", "1"]) == 2
    assert "--demo-min-reward filters played or sampled episodes" in capsys.readouterr().err
    assert main(["sft", "--env", "agentrl.envs.digits:Digits", "--demo-policy", "m:f", "--demo-best-of-n"]) == 2
    assert "--demo-best-of-n needs --demo-engine-url" in capsys.readouterr().err
    assert main(["sft", "--sft-data", "x.jsonl", "--colocate"]) == 2
    assert "--colocate is not supported with --loss-type sft_loss" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    assert main(["sft", "--sft-data", str(bad), "--save", str(tmp_path / "r")]) == 2
    assert f"{bad}:1: no assistant message" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    run = tmp_path / "old_run"  # a run folder without a complete checkpoint is never silently started over
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    assert main(["train", "--env", "agentrl.envs.digits:Digits", "--load", str(run)]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err
    (run / "config.json").write_text('{"rollout": {}, "train": {}}')  # the run's config.json is not a model's
    from agentrl.checkpoint import resolve_hf_checkpoint

    with pytest.raises(FileNotFoundError, match="a run folder without a complete checkpoint"):
        resolve_hf_checkpoint(run)


def test_agentrl_sft_learns_the_tool_call_and_rl_starts_from_its_folder(tiny_ckpt, tmp_path, ray_local, capsys):
    """SFT on scripted calculator demonstrations: the loss falls, iter_* checkpoints load in transformers,
    and greedy rollouts from the warm start emit parseable calculator calls (the untrained model never does)."""
    save = tmp_path / "warm"
    tasks = tmp_path / "tasks.jsonl"
    rows = Calculator.tasks(8, seed=5)
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = main(
        [
            "sft",
            "--env",
            "agentrl.envs.calculator:Calculator",
            "--prompt-data",
            str(tasks),
            "--hf-checkpoint",
            str(tiny_ckpt),
            "--demo-policy",
            "agentrl.envs.calculator:solver_policy",
            "--demo-min-reward",
            "1",
            "--num-epoch",
            "100",
            "--global-batch-size",
            "8",
            "--lr",
            "5e-3",
            "--save",
            str(save),
            "--save-interval",
            "50",
            "--eval-prompt-data",
            "calc",
            str(tasks),
            "--eval-interval",
            "100",
            "--eval-temperature",
            "0",
            "--rollout-max-turn-len",
            "48",
            "--max-turns",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "demonstrations: 8 of 8 demonstrations kept" in err
    lines = [json.loads(x) for x in open(save / "metrics.jsonl")]
    assert len(lines) == 100 and lines[-1]["epoch"] == pytest.approx(100.0)
    assert lines[-1]["sft_loss"] < 0.25 * lines[0]["sft_loss"]
    assert (save / "loss_curve.png").stat().st_size > 0 and len(open(save / "demos.jsonl").readlines()) == 8
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000050", "iter_0000100"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(save / "iter_0000100")
    # eval after the last step ran real episodes on the trained weights: the model now calls the tool
    assert lines[-1]["eval/calc/tool_call_rate"] >= 0.75, lines[-1]
    out = tmp_path / "greedy.jsonl"
    assert (
        main(
            [
                "rollout",
                "--env",
                "agentrl.envs.calculator:Calculator",
                "--prompt-data",
                str(tasks),
                "--hf-checkpoint",
                str(save),
                "--rollout-temperature",
                "0",
                "--rollout-max-turn-len",
                "48",
                "--max-turns",
                "1",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    samples = [json.loads(x) for x in open(out)]
    assert sum(s["metadata"]["tool_calls"] >= 1 for s in samples) >= 6
    assert sum(s["metadata"]["parse_errors"] for s in samples) <= 2
    base = tmp_path / "base.jsonl"
    assert (
        main(
            [
                "rollout",
                "--env",
                "agentrl.envs.calculator:Calculator",
                "--prompt-data",
                str(tasks),
                "--hf-checkpoint",
                str(tiny_ckpt),
                "--rollout-temperature",
                "0",
                "--rollout-max-turn-len",
                "48",
                "--max-turns",
                "1",
                "--output",
                str(base),
            ]
        )
        == 0
    )
    assert sum(json.loads(x)["metadata"]["tool_calls"] for x in open(base)) == 0
    # --load of an SFT run resumes SFT; RL refuses it as a resume point and points at --hf-checkpoint
    assert (
        main(
            [
                "train",
                "--env",
                "agentrl.envs.calculator:Calculator",
                "--load",
                str(save),
                "--hf-checkpoint",
                str(tiny_ckpt),
            ]
        )
        == 2
    )
    assert "pass it as --hf-checkpoint instead" in capsys.readouterr().err


def test_best_of_n_chooses_each_role_of_a_multi_role_env_apart(tiny_server, tiny_tokenizer, monkeypatch):
    import agentrl.rollout.generate as generate
    from agentrl.engines.http import SGLangEngine
    from agentrl.envs.tictactoe import TicTacToe
    from agentrl.rollout.episode import EpisodeContext

    real, played = generate.generate_rollout, []

    async def spy(*a, **kw):  # the real rollout, recorded: what best-of-n chose from
        out = await real(*a, **kw)
        played.extend(out[0])
        return out

    monkeypatch.setattr(generate, "generate_rollout", spy)
    engine = SGLangEngine(tiny_server)
    cfg = RolloutConfig(n_samples_per_prompt=6, max_turns=9, rollout_max_turn_len=48, rollout_seed=5)
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tiny_tokenizer), config=cfg)

    async def run():
        try:
            return await rejection_samples(ctx, TicTacToe, TicTacToe.tasks(4), min_reward=0.0, best_of_n=True)
        finally:
            await engine.close()

    kept, _ = asyncio.run(run())
    keys = [(s.group_index, s.metadata["role"]) for s in kept]
    assert kept and len(keys) == len(set(keys))  # one sample per task and role
    for s in kept:  # each role's own best, not the sample of whichever role won the episode
        rivals = [
            p.reward for p in played if (p.group_index, p.metadata.get("role")) == (s.group_index, s.metadata["role"])
        ]
        assert s.reward == max(r for r in rivals if r is not None), (s.metadata["role"], s.reward, rivals)


def _two_tools_rows(arguments_as_text: bool, tools_as_text: bool = True) -> list[dict]:
    """Two rows calling different tools: what a column store merges into one argument struct."""
    add = {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
    search = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "find",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }

    def row(user, tool, args, result, answer):
        call = {
            "id": "c1",
            "type": "function",
            "function": {
                "name": tool["function"]["name"],
                "arguments": json.dumps(args) if arguments_as_text else args,
            },
        }
        return {
            "messages": [
                {"role": "user", "content": user},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": result},
                {"role": "assistant", "content": answer},
            ],
            "tools": json.dumps([tool]) if tools_as_text else [tool],
        }

    return [row("add 1 and 2", add, {"a": 1, "b": 2}, "3", "3"), row("find x", search, {"query": "x"}, "ok", "done")]


def test_parquet_rows_with_json_string_arguments_train_exactly_what_was_written(tmp_path, template):
    import datasets

    from agentrl.data import read_rows

    rows = _two_tools_rows(arguments_as_text=True)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    samples, stats = conversation_samples(read_rows(tmp_path / "d.parquet"), template)
    assert stats.kept == 2
    assert '{"name": "add", "arguments": {"a": 1, "b": 2}}' in _spans(template, samples[0])[0]
    assert '{"name": "search", "arguments": {"query": "x"}}' in _spans(template, samples[1])[0]
    direct, _ = conversation_samples([(f"r{i}", r) for i, r in enumerate(rows)], template)  # the file changed nothing
    assert [s.tokens for s in samples] == [s.tokens for s in direct]


def test_parquet_object_arguments_get_other_rows_names_as_null_and_are_refused_with_the_fix(tmp_path, template):
    import datasets

    from agentrl.data import read_rows

    datasets.Dataset.from_list(_two_tools_rows(arguments_as_text=False)).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(DemoError) as err:
        conversation_samples(read_rows(tmp_path / "d.parquet"), template)
    text = str(err.value)
    assert text.startswith("2 demonstration(s) refused")
    assert "d.parquet[0]: messages[1].tool_calls[0]: arguments" in text and "unknown argument 'query'" in text
    assert "d.parquet[1]: messages[1].tool_calls[0]" in text and "unknown argument 'a'" in text
    assert "store function.arguments as a JSON string" in text
    # tool schemas stored as structs get the same union: each tool declares the other's parameters as null
    datasets.Dataset.from_list(_two_tools_rows(True, tools_as_text=False)).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(DemoError, match=r"t.parquet\[0\]: tools\[0\] \(add\) declares 'query' with no schema"):
        conversation_samples(read_rows(tmp_path / "t.parquet"), template)
    env = [json.loads(r["tools"])[0] for r in _two_tools_rows(True)]  # with the env's tools the row's are not rendered
    samples, _ = conversation_samples(list(read_rows(tmp_path / "t.parquet"))[:1], template, env_tools=env[:1])
    assert '{"name": "add", "arguments": {"a": 1, "b": 2}}' in _spans(template, samples[0])[0]


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"expression": 3}, "argument 'expression' must be a string, got integer 3"),
        ({"expression": "1", "precision": 2}, "unknown argument 'precision'"),
        ({}, "missing required argument 'expression'"),
    ],
)
def test_arguments_that_do_not_fit_the_env_schema_are_refused(template, arguments, message):
    row = _row()
    row["messages"][2]["tool_calls"][0]["function"]["arguments"] = arguments
    with pytest.raises(DemoError) as err:
        conversation_samples([("f.jsonl:7", row)], template, env_tools=TOOLS)
    assert "f.jsonl:7: messages[2].tool_calls[0]: arguments" in str(err.value) and message in str(err.value)
    assert "JSON string" not in str(err.value)  # no null: the columnar hint would mislead


class _ToolsAtReset(__import__("agentrl").Env):
    """Learns its tools at reset, as an MCP server behind an adapter lists them once connected."""

    closed = 0

    async def reset(self, *, seed=None, options=None):
        self.tools = Calculator.tools
        self.seen = (seed, dict(options or {}))
        _ToolsAtReset.last = self
        return [{"role": "user", "content": options["prompt"]}], {}

    async def step(self, action):
        return [], 0.0, True, False, {}

    async def close(self):
        _ToolsAtReset.closed += 1
        await super().close()


def test_env_tools_offered_only_after_reset_are_read_by_resetting_once(template):
    from agentrl.runtime.sft import demo_task, env_tool_schemas

    assert _ToolsAtReset().tool_schemas() == []
    task = demo_task({**_row(), "label": "23", "difficulty": 2})
    assert task == {"prompt": "What is 3 + 4 * 5?", "label": "23", "difficulty": 2}
    tools = env_tool_schemas(_ToolsAtReset, task, seed=7, timeout=5.0)
    assert tools == TOOLS and _ToolsAtReset.last.seen == (7, task) and _ToolsAtReset.closed == 1
    (s,), _ = conversation_samples([("f.jsonl:1", _row())], template, env_tools=tools)  # refused before the fix
    assert s.token_exact
    assert env_tool_schemas(Calculator, task, seed=7, timeout=5.0) == TOOLS  # declared up front: no reset
    # no demonstration calls a tool: a tool-less env is not started just to learn it has none
    assert env_tool_schemas(_ToolsAtReset, task, seed=7, timeout=5.0, reset_if_none=False) == []

    class Broken(_ToolsAtReset):
        async def reset(self, *, seed=None, options=None):
            raise RuntimeError("server down")

    with pytest.raises(
        ValueError, match="offers none before reset, and reset.. with the first task raised RuntimeError: server down"
    ):
        env_tool_schemas(Broken, task, seed=0, timeout=5.0)
    assert _ToolsAtReset.closed == 2  # closed even so


def test_sft_data_with_an_env_whose_tools_arrive_at_reset_loads(tiny_ckpt, tmp_path):
    from agentrl.config import RunConfig
    from agentrl.runtime.sft import load_demonstrations

    (tmp_path / "d.jsonl").write_text(json.dumps(_row()) + "\n")
    cfg = RunConfig(sft_data=str(tmp_path / "d.jsonl"))
    (s,) = load_demonstrations(cfg, _ToolsAtReset, [], tiny_ckpt)
    assert s.token_exact and _ToolsAtReset.last.seen[1]["prompt"] == "What is 3 + 4 * 5?"
