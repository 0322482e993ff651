"""Several policies in one run (issue 40, part 4): an adapter per ``--policy``, one mixed micro-batch stream.

On the tiny 2-layer Llama in fp32 on CPU. What each test pins down:

* a packed micro-batch mixing two policies' rows gives each row its own adapter's log-probs (those of a plain PEFT
  forward with that adapter alone, within 1e-5), and each adapter's gradient equals the one a step over its rows
  alone gives (its own loss normalization and clipping), so one mixed stream trains both as separately;
* per-policy learning rates, AdamW state on adapters only, the KL reference with every adapter off;
* checkpoints hold ``adapters/NAME`` in PEFT's format, which ``PeftModel.from_pretrained`` loads to the trainer's
  log-probs, and ``load`` resumes every adapter and its optimizer;
* bad ``--policy`` / ``--role-policy`` values are refused naming the flag;
* ``agentrl train`` with two policies on an env of two roles: each seat's requests name its policy's adapter on
  the embedded engines, samples carry the policy, metrics have ``reward_mean/<policy>``, the run saves and resumes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import Linear as LoraLinear
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import agentrl
from agentrl.config import RunConfig, TrainConfig
from agentrl.trainer.batching import pack_samples
from agentrl.trainer.lora import POLICIES_DIR
from agentrl.trainer.lora_policies import policy_spans, routed
from agentrl.trainer.torch_trainer import TorchTrainer
from tests.test_lora import _max_diff
from tests.test_trainer import capture_grads, cfg, make_samples, reference_log_probs

POLICIES = ["solver", "judge"]


class Duet(agentrl.Env):
    """Two roles, two turns each, in turn: a reward that varies with what each says (so both policies get
    gradients, and their adapters part after one step)."""

    roles = ("a", "b")

    @staticmethod
    def tasks(n: int = 64) -> list[dict]:
        return [{"prompt": "duet", "label": ""} for _ in range(n)]

    async def reset(self, *, seed=None, options=None):
        self.turn = 0
        return {"a": [{"role": "user", "content": "Sing."}], "b": [{"role": "user", "content": "Listen."}]}, {}

    def current_role(self):
        return "ab"[self.turn % 2]

    async def step(self, action):
        me, other = "ab"[self.turn % 2], "ab"[(self.turn + 1) % 2]
        self.turn += 1
        reward = {me: (len(action.text) % 3) / 2}
        if self.turn >= 4:
            return {}, reward, True, False, {}
        return {other: [{"role": "user", "content": f"Heard {len(action.text)}."}]}, reward, False, False, {}


def policies_cfg(**kw) -> TrainConfig:
    return cfg(**{"lora_rank": 4, "lora_alpha": 8.0, "lr": 5e-3, "policy": POLICIES, **kw})


def _randomize_adapters(trainer: TorchTrainer, seed: int = 0) -> None:
    """Non-zero B (and A) for every adapter: adapters that differ, so a token on the wrong one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def _mixed(n: int, seed: int):
    samples = make_samples(n, seed=seed)
    for i, s in enumerate(samples):
        s.policy = POLICIES[i % 2]
    return samples


def _prime(trainer: TorchTrainer, samples) -> None:
    lp = trainer.compute_log_probs(samples, ref=False)
    for s, old in zip(samples, lp.old):
        s.old_log_probs = old


def test_a_mixed_micro_batch_gives_each_row_its_own_adapter(tiny_ckpt):
    trainer = TorchTrainer(tiny_ckpt, policies_cfg())
    _randomize_adapters(trainer)
    samples = _mixed(8, seed=1)
    mixed = trainer.compute_log_probs(samples, ref=False)  # one packed row holds both policies' samples
    # each row against a plain PEFT forward with its adapter alone (active), no routing
    for name in POLICIES:
        trainer.peft.base_model.set_adapter(name)
        for s, got in zip(samples, mixed.old):
            if s.policy == name:
                want = reference_log_probs(trainer.model, s)
                torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)
    # and the adapters really differ (a row on the wrong adapter would be caught)
    trainer.peft.base_model.set_adapter("judge")
    s = next(s for s in samples if s.policy == "solver")
    assert (reference_log_probs(trainer.model, s) - torch.tensor(mixed.old[0])).abs().max() > 1e-3


def test_policy_spans_merge_neighbours_and_refuse_a_sample_of_no_policy():
    assert policy_spans(["a", "a", "b", "a"], [3, 2, 4, 1], ["a", "b"]) == [("a", 5), ("b", 4), ("a", 1)]
    assert policy_spans(["b"], [3], ["a", "b", "c"]) == [("b", 3), ("a", 0), ("c", 0)]  # every adapter in the graph
    assert policy_spans([], [], ["a"]) == [("a", 0)]
    with pytest.raises(ValueError, match="policy None"):
        policy_spans(["a", None], [2, 2], ["a", "b"])


def test_rows_interleaved_across_policies_each_take_their_own_adapter(tiny_ckpt):
    """A row packed a, b, a, b (four spans: the trainer sorts its rows, a caller of routed() need not)."""
    trainer = TorchTrainer(tiny_ckpt, policies_cfg())
    _randomize_adapters(trainer, seed=3)
    samples = _mixed(4, seed=4)
    batch = pack_samples(samples)
    assert [n > 0 for _, n in policy_spans(batch.policies, batch.lengths, POLICIES)] == [True] * 4
    with torch.no_grad():
        logp = trainer._logits(trainer.model, batch).float().log_softmax(-1)
    got = logp.gather(1, batch.targets[:, None])[:, 0].split(batch.response_lengths)
    adapted = [m for m in trainer.model.modules() if isinstance(m, LoraLinear)]
    assert adapted and not any("forward" in m.__dict__ for m in adapted), "routing outlived its forward"
    for name in POLICIES:
        trainer.peft.base_model.set_adapter(name)
        for s, g in zip(samples, got):
            if s.policy == name:
                torch.testing.assert_close(g, reference_log_probs(trainer.model, s), atol=1e-5, rtol=0)


def test_routing_survives_activation_checkpointing_and_is_not_reentered(tiny_ckpt):
    """Checkpointing runs each layer's forward again in backward: still routed, the same gradients."""
    samples = _mixed(8, seed=6)
    grads = []
    for checkpointing in (False, True):
        trainer = TorchTrainer(tiny_ckpt, policies_cfg(gradient_checkpointing=checkpointing))
        _randomize_adapters(trainer, seed=7)
        _prime(trainer, [dataclasses.replace(s) for s in samples])
        seen = capture_grads(trainer)
        trainer.train_step([dataclasses.replace(s, old_log_probs=None) for s in samples])
        grads.append(seen[0])
    assert grads[0].keys() == grads[1].keys() and any(g.any() for g in grads[0].values())
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-5, rtol=1e-4)
    with routed(trainer.model, [("solver", 3)]), pytest.raises(RuntimeError, match="already routing"):
        with routed(trainer.model, [("judge", 3)]):
            pass


@pytest.mark.parametrize("per_token", [False, True])
def test_each_adapters_gradient_from_the_mixed_stream_is_its_own_step(tiny_ckpt, per_token):
    kw = {"calculate_per_token_loss": per_token, "clip_grad": 0.05, "max_tokens_per_gpu": 48}
    mixed_trainer = TorchTrainer(tiny_ckpt, policies_cfg(**kw))
    _randomize_adapters(mixed_trainer, seed=5)
    samples = _mixed(8, seed=2)
    _prime(mixed_trainer, samples)
    seen = capture_grads(mixed_trainer)
    metrics = mixed_trainer.train_step(samples)
    assert len(seen) == 1
    assert {f"grad_norm/{p}" for p in POLICIES} <= set(metrics) and {f"pg_loss/{p}" for p in POLICIES} <= set(metrics)
    mixed = dict(mixed_trainer.model.named_parameters())
    for name in POLICIES:  # the same policy's samples, in a step of their own, on a trainer of their own
        alone_trainer = TorchTrainer(tiny_ckpt, policies_cfg(**kw))
        _randomize_adapters(alone_trainer, seed=5)
        alone_seen = capture_grads(alone_trainer)
        alone_trainer.train_step([dataclasses.replace(s) for s in samples if s.policy == name])
        own = {n: g for n, g in alone_seen[0].items() if f".{name}." in n}
        others = [g for n, g in alone_seen[0].items() if f".{name}." not in n]
        # a policy without rows in a step steps on a zero gradient, as a step of its own with nothing to learn would
        assert own and others and all(not g.any() for g in others), "a step over one policy's rows touched another"
        for n, g in own.items():
            torch.testing.assert_close(seen[0][n], g, atol=1e-5, rtol=1e-4)
        # clipped per policy, then stepped: the same adapter. AdamW's first step moves a weight by about
        # lr * g / (|g| + eps): for a gradient element near eps, float noise in g moves it visibly, so the weights
        # agree to 2% of one step (the gradients above agree to 1e-5)
        for n, p in alone_trainer.model.named_parameters():
            if f".{name}." in n:
                torch.testing.assert_close(mixed[n], p, atol=0.02 * 5e-3, rtol=0)


def test_policy_learning_rates_adapter_state_and_the_kl_reference(tiny_ckpt):
    trainer = TorchTrainer(tiny_ckpt, policies_cfg(policy_lr=["judge=1e-4"], use_kl_loss=True, kl_loss_coef=0.1))
    groups = {g["policy"]: g for g in trainer.optimizer.param_groups}
    assert groups["solver"]["lr"] == 5e-3 and groups["judge"]["lr"] == 1e-4
    for name, group in groups.items():
        names = {n for n, p in trainer.model.named_parameters() if any(p is q for q in group["params"])}
        assert names and all(f".lora_A.{name}." in n or f".lora_B.{name}." in n for n in names)
    assert trainer.ref_model is None and trainer.has_reference
    base = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt)).eval()
    _randomize_adapters(trainer)
    samples = _mixed(4, seed=3)
    lp = trainer.compute_log_probs(samples, ref=True)
    assert lp.ref is not None
    for s, ref in zip(samples, lp.ref):  # every adapter off: the base model's own forward
        torch.testing.assert_close(torch.tensor(ref), reference_log_probs(base, s), atol=1e-5, rtol=0)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_" not in n}
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_" in n}
    for s, old, ref in zip(samples, lp.old, lp.ref):
        s.old_log_probs, s.ref_log_probs = old, ref
    metrics = trainer.train_step(samples)
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)
    # the reference pass (every adapter off) left every policy trainable: both moved, at their own rates
    for name in POLICIES:
        assert metrics[f"grad_norm/{name}"] > 0
        moved = [n for n, p in trainer.model.named_parameters() if f".{name}." in n and not torch.equal(p, adapters[n])]
        assert moved, f"policy {name}'s adapter did not move"
    assert {id(p) for p in trainer.optimizer.state} == {
        id(p) for n, p in trainer.model.named_parameters() if ".lora_" in n
    }


def test_checkpoint_holds_each_policys_peft_adapter_and_resumes_exactly(tiny_ckpt, tmp_path):
    trainer = TorchTrainer(tiny_ckpt, policies_cfg())
    samples = _mixed(8, seed=4)
    for _ in range(2):
        _prime(trainer, samples)
        trainer.train_step(samples)
    trainer.save(tmp_path / "iter_2")
    # model.safetensors is the unchanged base (the engines get the adapters by name)
    saved = load_file(str(tmp_path / "iter_2" / "model.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt)).state_dict()
    assert saved and all(torch.equal(saved[k], base[k]) for k in saved)
    resumed = TorchTrainer(tiny_ckpt, policies_cfg())
    resumed.load(tmp_path / "iter_2")
    for t in (trainer, resumed):
        _prime(t, samples)
        t.train_step(samples)
    for (n, p), (m, q) in zip(trainer.model.named_parameters(), resumed.model.named_parameters()):
        assert n == m
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    resumed.save(tmp_path / "iter_3")
    for name in POLICIES:  # each folder is PEFT's own: from_pretrained gives the trainer's log-probs
        folder = tmp_path / "iter_3" / POLICIES_DIR / name
        assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_ckpt)), str(folder))
        resumed.peft.base_model.set_adapter(name)  # (PEFT freezes the other adapters: the last use of `resumed`)
        for s in samples[:3]:
            torch.testing.assert_close(
                reference_log_probs(peft_model.eval(), s), reference_log_probs(resumed.model, s), atol=1e-5, rtol=0
            )
    with pytest.raises(ValueError, match="several policies"):
        TorchTrainer(tiny_ckpt, cfg(lora_rank=4, lora_alpha=8.0)).load(tmp_path / "iter_2")
    # a resumed run trains at the rates it is given, not the saved run's
    faster = TorchTrainer(tiny_ckpt, policies_cfg(lr=1e-2, policy_lr=["judge=3e-3"]))
    faster.load(tmp_path / "iter_2")
    assert {g["policy"]: g["lr"] for g in faster.optimizer.param_groups} == {"solver": 1e-2, "judge": 3e-3}
    # another order would hand each policy the other's AdamW state: refused naming --policy
    with pytest.raises(ValueError, match=r"resume it with the same --policy flags, not \['judge', 'solver'\]"):
        TorchTrainer(tiny_ckpt, policies_cfg(policy=["judge", "solver"])).load(tmp_path / "iter_2")


def test_a_policy_named_like_a_module_keeps_peft_tensor_names(tiny_ckpt, tmp_path):
    trainer = TorchTrainer(tiny_ckpt, policies_cfg(policy=["mlp", "layers"]))
    trainer.save(tmp_path / "iter_0")
    from safetensors import safe_open

    for name in ("mlp", "layers"):
        with safe_open(str(tmp_path / "iter_0" / POLICIES_DIR / name / "adapter_model.safetensors"), "pt") as f:
            keys = list(f.keys())
        assert "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight" in keys, keys[:3]
        PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(tiny_ckpt)), str(tmp_path / "iter_0" / POLICIES_DIR / name)
        )


def test_the_lm_head_is_not_adapted_per_policy(tiny_ckpt):
    with pytest.raises(ValueError, match="the LM head is not adapted"):
        TorchTrainer(tiny_ckpt, policies_cfg(lora_target_modules=["q_proj", "lm_head"]))


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"policy": ["a", "b"]}, "pass --lora-rank"),
        ({"policy": ["a"], "lora_rank": 4}, "name two or more"),
        ({"policy": ["a", "a"], "lora_rank": 4}, "twice"),
        ({"policy": ["a", "__base__"], "lora_rank": 4}, "letters, digits"),
        ({"policy": ["a", "b"], "lora_rank": 4, "policy_lr": ["c=1e-4"]}, "--policy-lr takes NAME=LR"),
        ({"policy": ["a", "b"], "lora_rank": 4, "policy_lr": ["a=-1"]}, "--policy-lr must be numbers > 0"),
        ({"policy": ["a", "b"], "lora_rank": 4, "policy_lr": ["a=fast"]}, "--policy-lr must be numbers > 0"),
        ({"policy": ["a", "b"], "lora_rank": 4, "advantage_estimator": "ppo"}, "the critic is one model"),
        ({"policy_lr": ["a=1e-4"]}, "needs the policies it names"),
        ({"policy": ["a", "b"], "lora_rank": 4, "policy_lr": ["a=1e-4", "a=2e-4"]}, "twice"),
    ],
)
def test_bad_policy_values_are_refused_naming_the_flag(kw, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kw).validate()


def _run(tmp_path, **kw) -> RunConfig:
    base = dict(
        train=TrainConfig(lora_rank=4, policy=["x_player", "o_player"]),
        rollout=dataclasses.replace(RunConfig().rollout, role_policy=["x=x_player", "o=o_player"]),
        env="agentrl.envs.tictactoe:TicTacToe",
        weight_sync="adapter",
        hf_checkpoint=str(tmp_path),
    )
    base.update(kw)
    return RunConfig(**base)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"weight_sync": "auto"}, "pass --weight-sync adapter"),
        ({"custom_generate_function_path": "m:f"}, "does not\nknow|does not know"),
        ({"rollout": {"role_policy": ["x=x_player", "o=nobody"]}}, "unknown policy"),
        ({"rollout": {"role_policy": ["x=x_player"]}}, "plays no seat"),
        ({"rollout": {"role_policy": ["x=x_player", "x=o_player"]}}, "more than once"),
        ({"rollout": {"role_policy": ["x"]}}, "--role-policy takes ROLE=NAME"),
        (
            {"rollout": {"role_policy": ["x=x_player", "o=o_player"], "role_engine_url": ["o=http://127.0.0.1:1"]}},
            "a role is played by a trained policy or by a fixed engine",
        ),
    ],
)
def test_bad_seats_are_refused_naming_the_flag(tmp_path, change, message):
    kw = dict(change)
    if "rollout" in kw:
        kw["rollout"] = dataclasses.replace(RunConfig().rollout, **kw["rollout"])
    with pytest.raises(ValueError, match=message):
        _run(tmp_path, **kw).validate()


@pytest.mark.e2e
def test_agentrl_train_with_two_policies_seats_each_role_on_its_adapter_and_resumes(tiny_ckpt, tmp_path, ray_local):
    """A duet, role a played by policy x_player and b by o_player, on the embedded engines with --weight-sync adapter:
    every push loads both adapters by name; each seat's requests name its policy's adapter, so the engine's log-probs
    of the sampled tokens equal the trainer's under that policy's adapter (--true-on-policy-mode, from the second
    step on, when the two adapters differ); samples and metrics carry the policies; checkpoints hold adapters/NAME;
    --load resumes."""
    from agentrl.runtime.train import train
    from tests.test_train import _cfg, _dump, _lines

    save = tmp_path / "run"
    policies = {"lora_rank": 4, "lr": 2e-2, "policy": ["x_player", "o_player"], "policy_lr": ["o_player=1e-2"]}
    kw = dict(
        env="tests.test_policies:Duet",
        save_interval=1,
        true_on_policy_mode=True,
        weight_sync="adapter",
        train=policies,
        rollout={"role_policy": ["a=x_player", "b=o_player"], "max_turns": 4, "rollout_max_turn_len": 40},
    )
    summary = train(_cfg(tiny_ckpt, save, num_rollout=2, **kw))
    assert summary["weight_version"] == 2 and summary["weight_sync"] == ["adapter"]
    lines = _lines(save)
    assert [line["step"] for line in lines] == [0, 1]
    for line in lines:
        assert line["true_on_policy_logprob_diff_max"] < 1e-3  # each seat sampled on its own policy's adapter
        for name in ("x_player", "o_player"):
            assert f"reward_mean/{name}" in line and f"grad_norm/{name}" in line and f"pg_loss/{name}" in line
        assert line["reward_mean/x_player"] == line["reward_mean/a"]  # one seat each
        assert line["grad_norm/x_player"] > 0 and line["grad_norm/o_player"] > 0  # both policies trained
        assert line["lr/x_player"] == 2e-2 and line["lr/o_player"] == 1e-2  # each policy's own (--policy-lr)
    for s in _dump(save, 1):
        assert s["metadata"]["policy"] == {"a": "x_player", "b": "o_player"}[s["metadata"]["role"]]
    last = save / "iter_0000002"
    for name in ("x_player", "o_player"):
        assert (last / POLICIES_DIR / name / "adapter_model.safetensors").is_file()
    summary = train(_cfg(tiny_ckpt, save, num_rollout=3, load=str(save), **kw))
    assert summary["weight_version"] == 3
    lines = _lines(save)
    assert [line["step"] for line in lines] == [0, 1, 2] and lines[-1]["true_on_policy_logprob_diff_max"] < 1e-3


@pytest.mark.e2e
def test_agentrl_train_with_two_policies_on_two_fsdp2_ranks(tiny_ckpt, tmp_path, ray_local):
    """The duet with two trainer ranks (FSDP2, --trainer-num-procs 2): every push gathers both adapters from the
    shards and the embedded engine serves them by name, so each seat samples on its own policy's adapter (the
    engine's log-probs equal the trainer's, --true-on-policy-mode), and both policies train."""
    from agentrl.runtime.train import train
    from tests.test_train import _cfg, _lines

    save = tmp_path / "run"
    kw = dict(
        env="tests.test_policies:Duet",
        true_on_policy_mode=True,
        weight_sync="adapter",
        trainer_num_procs=2,
        train={"lora_rank": 4, "lr": 2e-2, "policy": ["x_player", "o_player"]},
        rollout={"role_policy": ["a=x_player", "b=o_player"], "max_turns": 4, "rollout_max_turn_len": 40},
    )
    summary = train(_cfg(tiny_ckpt, save, num_rollout=2, **kw))
    assert summary["weight_version"] == 2
    lines = _lines(save)
    assert [line["step"] for line in lines] == [0, 1]
    for line in lines:
        assert line["true_on_policy_logprob_diff_max"] < 1e-3  # the second step: two adapters that differ
        assert line["grad_norm/x_player"] > 0 and line["grad_norm/o_player"] > 0


@pytest.mark.e2e
def test_two_policies_on_launched_servers_load_both_adapters_by_name(tiny_ckpt, tmp_path, ray_local):
    """--rollout-backend sglang (launched `agentrl serve`, SGLang's API): each push writes each policy's adapter as a
    PEFT folder the servers load under the policy's name (/load_lora_adapter); each seat's requests name its own
    (--true-on-policy-mode holds); a server killed between steps comes back serving both."""
    import os
    import signal

    import httpx

    from agentrl.runtime.train import _Runtime, train
    from tests.test_train import _cfg, _lines

    save = tmp_path / "run"
    kw = dict(
        env="tests.test_policies:Duet",
        rollout_backend="sglang",
        sglang_launcher="agentrl",
        true_on_policy_mode=True,
        weight_sync="adapter",
        train={"lora_rank": 4, "lr": 2e-2, "policy": ["x_player", "o_player"]},
        rollout={"role_policy": ["a=x_player", "b=o_player"], "max_turns": 4, "rollout_max_turn_len": 40},
    )
    served: list[set[str]] = []
    sync = _Runtime.sync_weights

    def kill_then_sync(self, version):  # the server dies between steps: the monitor restarts it, it reloads both
        if version == 2 and not served:
            os.killpg(self.engines.pids()[0], signal.SIGKILL)
            assert self.engines.check_and_restart() == [0]
            url, headers = self.engines.urls[0], self.engines.launch.headers
            served.append({m["id"] for m in httpx.get(url + "/v1/models", headers=headers).json()["data"]})
        return sync(self, version)

    _Runtime.sync_weights = kill_then_sync
    try:
        summary = train(_cfg(tiny_ckpt, save, num_rollout=3, **kw))
    finally:
        _Runtime.sync_weights = sync
    assert summary["weight_sync"] == ["adapter"] and summary["weight_version"] == 3
    lines = _lines(save)
    assert [line["step"] for line in lines] == [0, 1, 2] and all(line["count_failed"] == 0 for line in lines)
    assert all(line["true_on_policy_logprob_diff_max"] < 1e-3 for line in lines)
    assert served and {"x_player", "o_player"} <= served[0]
    assert sorted(p.name for p in (save / "weight_sync" / "adapter-3").iterdir()) == ["o_player", "x_player"]


def test_seats_the_env_lacks_or_leaves_unseated_are_refused_before_anything_starts(tiny_ckpt, tmp_path, capsys):
    from agentrl.cli import main

    flags = ["train", "--env", "tests.test_policies:Duet", "--hf-checkpoint", str(tiny_ckpt), "--lora-rank", "4"]
    flags += ["--weight-sync", "adapter", "--policy", "p", "--policy", "q", "--save", str(tmp_path / "run")]
    assert main([*flags, "--role-policy", "a=p", "--role-policy", "z=q"]) == 2
    assert "--role-policy names role(s) ['z'] the env does not have" in capsys.readouterr().err
    assert main([*flags, "--role-policy", "a=p", "--role-policy", "a=q"]) == 2
    assert "more than once" in capsys.readouterr().err
    three = ["--policy", "r", "--role-policy", "a=p", "--role-policy", "b=q"]
    assert main([*flags, *three]) == 2
    assert "--policy r plays no seat" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


async def test_every_role_must_be_seated_when_policies_train():
    from agentrl.config import RolloutConfig
    from agentrl.rollout.generate import check_role_policies

    class Trio(Duet):
        roles = ("a", "b", "c")

    config = RolloutConfig(role_policy=["a=p", "b=q"])
    with pytest.raises(ValueError, match=r"role\(s\) \['c'\] of the env are played by no policy"):
        await check_role_policies(config, Trio, every_role=True)
    await check_role_policies(config, Trio)  # eval of some seats' adapters: the rest play on the engine's base
    fixed = RolloutConfig(role_policy=["a=p", "b=q"], role_engine_url=["c=http://127.0.0.1:9"])
    await check_role_policies(fixed, Trio, every_role=True)  # c on a fixed engine: seated
    with pytest.raises(ValueError, match="the env has none"):
        await check_role_policies(config, agentrl.Env, every_role=True)


@pytest.mark.e2e
def test_two_policies_on_two_fsdp2_ranks_match_one_rank(tiny_ckpt, tmp_path):
    """Two Ray actors sharding the base and both adapters with FSDP2 over gloo. Rank 0's shard holds only the
    solver's rows and rank 1's only the judge's (in micro-batches of different counts, so one rank runs an empty
    pass): every adapter still reduces a gradient on every rank, and the log-probs, per-policy metrics, adapters
    after two steps and the saved PEFT folders equal one rank's."""
    ray = pytest.importorskip("ray")
    from agentrl.runtime.cluster import init_ray
    from agentrl.runtime.engine_group import numpy_to_tensors
    from agentrl.runtime.trainer_group import TrainerGroup

    started = not ray.is_initialized()
    init_ray(num_cpus=2)
    samples = make_samples(8, seed=21)
    for i, s in enumerate(samples):  # the group splits a global batch in contiguous halves: solver's, then judge's
        s.policy = POLICIES[i // 4]
    samples[0].tokens = [5] * 12 + samples[0].tokens  # a longer prompt: rank 0 packs more micro-batches
    kw = {"clip_grad": 0.05, "max_tokens_per_gpu": 24, "global_batch_size": 8, "num_steps_per_rollout": 1}
    config = policies_cfg(use_kl_loss=True, kl_loss_coef=0.5, **kw)
    group = TrainerGroup(tiny_ckpt, config, world_size=2, num_cpus=1)
    try:
        single = TorchTrainer(tiny_ckpt, config)
        counts = [len(single._micro_batches(samples[h : h + 4], train=True)) for h in (0, 4)]
        assert counts[0] != counts[1], counts  # one rank pads with an empty pass
        for _ in range(2):  # the second step trains A too (B is no longer zero)
            lp_group, lp_single = (
                group.compute_log_probs(samples, ref=True),
                single.compute_log_probs(samples, ref=True),
            )
            assert _max_diff(lp_group.ref, lp_single.ref) < 1e-5 and _max_diff(lp_group.old, lp_single.old) < 1e-5
            for s, old, ref in zip(samples, lp_single.old, lp_single.ref):
                s.old_log_probs, s.ref_log_probs = old, ref
            m_group, m_single = group.train_step(samples), single.train_step(samples)
            for key in ("loss", "kl", *(f"pg_loss/{p}" for p in POLICIES)):
                assert m_group[key] == pytest.approx(m_single[key], abs=1e-5), key
            for p in POLICIES:
                assert m_single[f"grad_norm/{p}"] > 0
                assert m_group[f"grad_norm/{p}"] == pytest.approx(m_single[f"grad_norm/{p}"], rel=1e-4), p
        fresh = TorchTrainer(tiny_ckpt, config)
        for p in POLICIES:
            got, _ = group._adapter(p)
            want, _ = single.adapter_weights(p)
            start, _ = fresh.adapter_weights(p)
            assert got.keys() == want.keys()
            for name, t in numpy_to_tensors(got).items():
                torch.testing.assert_close(t, want[name], atol=1e-5, rtol=0)
            assert all((want[n] - start[n]).abs().max() > 0 for n in want), f"{p}: an adapter tensor did not train"
        group.save(tmp_path / "group")
        single.save(tmp_path / "single")
        for p in POLICIES:
            a = load_file(str(tmp_path / "group" / POLICIES_DIR / p / "adapter_model.safetensors"))
            b = load_file(str(tmp_path / "single" / POLICIES_DIR / p / "adapter_model.safetensors"))
            assert a.keys() == b.keys() and all((a[n] - b[n]).abs().max() <= 1e-5 for n in a)
    finally:
        group.shutdown()
        if started:
            ray.shutdown()
