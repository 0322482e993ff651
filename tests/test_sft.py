"""``agentrl sft`` end to end: the loss, the flags it refuses, a warm start that learns, the env's tools.

Real parts: the tiny model and tokenizer, the calculator env and its tool, a local Ray cluster with
the trainer and engine actors, safetensors checkpoints. The demonstrations themselves are tested in
``test_sft_conversations.py`` (rows) and ``test_sft_sources.py`` (played and sampled).
"""

from __future__ import annotations

import json

import pytest
import torch

from agentrl.chat import ChatTemplate
from agentrl.cli import main
from agentrl.config import TrainConfig
from agentrl.envs.calculator import Calculator
from agentrl.rollout.demos import conversation_samples
from tests.test_sft_conversations import TOOLS, _row


@pytest.fixture(scope="module")
def template(tiny_tokenizer):
    return ChatTemplate(tiny_tokenizer)


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
    assert 100 < lines[-1]["trainer_peak_rss_mb"] < 24 * 1024  # each step reports the trainer actor's peak memory
    assert (save / "loss_curve.png").stat().st_size > 0 and len(open(save / "demos.jsonl").readlines()) == 8
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000050", "iter_0000100"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(save / "iter_0000100")
    # eval after the last step ran real episodes on the trained weights: the model now calls the tool
    assert lines[-1]["eval/calc/tool_call_rate"] >= 0.75, lines[-1]

    def greedy_rollout(checkpoint, output) -> int:  # `agentrl rollout` at temperature 0, in this process
        flags = ["--prompt-data", str(tasks), "--hf-checkpoint", str(checkpoint), "--rollout-temperature", "0"]
        flags += ["--rollout-max-turn-len", "48", "--max-turns", "1", "--output", str(output)]
        return main(["rollout", "--env", "agentrl.envs.calculator:Calculator", *flags])

    out = tmp_path / "greedy.jsonl"
    assert greedy_rollout(save, out) == 0
    samples = [json.loads(x) for x in open(out)]
    assert sum(s["metadata"]["tool_calls"] >= 1 for s in samples) >= 6
    assert sum(s["metadata"]["parse_errors"] for s in samples) <= 2
    base = tmp_path / "base.jsonl"
    assert greedy_rollout(tiny_ckpt, base) == 0
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


def test_reading_the_tools_reports_a_system_exit_and_a_failing_close_hides_nothing(capsys):
    from agentrl.runtime.sft import env_tool_schemas

    class CloseFails(_ToolsAtReset):
        async def close(self):
            raise RuntimeError("close broke")

    assert env_tool_schemas(CloseFails, {"prompt": "q"}, seed=0, timeout=5.0) == TOOLS  # the tools read stand
    assert "close() after the reset failed: RuntimeError: close broke" in capsys.readouterr().err

    class Exits(CloseFails):
        async def reset(self, *, seed=None, options=None):
            raise SystemExit(3)

    with pytest.raises(ValueError, match="reset.. with the first task raised SystemExit: 3"):  # not the close's error
        env_tool_schemas(Exits, {"prompt": "q"}, seed=0, timeout=5.0)
    assert "close() after the reset failed: RuntimeError: close broke" in capsys.readouterr().err


def test_reading_the_tools_of_an_env_with_sync_methods(capsys):
    """A sync ``reset`` and ``close`` (the Env contract allows both) are called in a worker thread:
    the tools it sets at reset are read and no false close failure is printed."""
    from agentrl.runtime.sft import env_tool_schemas

    class SyncTools(_ToolsAtReset):
        def reset(self, *, seed=None, options=None):
            self.tools = Calculator.tools
            return [{"role": "user", "content": "q"}], {}

        def close(self):
            pass

    assert env_tool_schemas(SyncTools, {"prompt": "q"}, seed=0, timeout=5.0) == TOOLS
    assert "close() after the reset failed" not in capsys.readouterr().err
