"""LoRA on the torch backend (issue 40, part 1): PEFT adapters trained, referenced, merged, saved and resumed.

On the tiny 2-layer Llama in fp32 on CPU. What each test pins down:

* only the adapter trains and carries AdamW state; the base's weights do not move;
* the KL reference is the base with the adapter off (no second model), equal to the base's own log-probs;
* the engines get the merged weights under the base's names: ``W + alpha/r * B @ A``, computed here by hand;
* a checkpoint holds a plain HF folder (the merged model) and ``adapter/`` in PEFT's format, which
  ``peft.PeftModel.from_pretrained`` loads to the same log-probs as the trainer's;
* ``load`` resumes the adapter and its optimizer exactly, and refuses a checkpoint of the other kind;
* FSDP2 over two Ray actors takes the same LoRA step as one rank;
* bad LoRA flags are refused naming the flag, before any weight loads.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from agentrl.config import TrainConfig
from agentrl.trainer.lora import ADAPTER_DIR, check_lora
from agentrl.trainer.torch_trainer import TorchTrainer
from tests.test_trainer import assert_group_weights_match, cfg, make_samples, reference_log_probs


def lora_cfg(**kw) -> TrainConfig:
    return cfg(**{"lora_rank": 4, "lora_alpha": 8.0, "lr": 5e-3, **kw})


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def _step(trainer: TorchTrainer, samples) -> dict[str, float]:
    lp = trainer.compute_log_probs(samples, ref=trainer.has_reference)
    for s, old in zip(samples, lp.old):
        s.old_log_probs = old
    for s, ref in zip(samples, lp.ref or [None] * len(samples)):
        s.ref_log_probs = ref
    return trainer.train_step(samples)


def test_only_the_adapter_trains_and_the_kl_reference_is_the_base(tiny_ckpt):
    trainer = TorchTrainer(tiny_ckpt, lora_cfg(use_kl_loss=True, kl_loss_coef=0.5))
    assert trainer.ref_model is None and trainer.has_reference  # the base with the adapter off, not a second model
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    base = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt)).eval()
    samples = make_samples(8, seed=3)
    before = trainer.compute_log_probs(samples, ref=True)
    assert before.ref is not None
    for s, ref in zip(samples, before.ref):  # the reference is the base model's own forward
        torch.testing.assert_close(torch.tensor(ref), reference_log_probs(base, s), atol=1e-5, rtol=0)
    # B starts at zero: the adapted policy starts as the base
    assert _max_diff(before.old, before.ref) == 0.0
    for _ in range(3):
        metrics = _step(trainer, samples)
    after = trainer.compute_log_probs(samples, ref=True)
    assert _max_diff(after.old, before.old) > 1e-3, "the adapter did not move the policy"
    assert after.ref is not None and _max_diff(after.ref, before.ref) == 0.0, "the reference moved"
    assert metrics["kl"] != 0.0  # the KL term saw the policy leave the base
    for n, p in trainer.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"base weight {n} moved"
    # AdamW holds state for the adapter's tensors only
    state_params = {id(p) for p in trainer.optimizer.state}
    assert state_params == {id(p) for n, p in trainer.model.named_parameters() if n in trained}


def test_the_engines_get_the_merged_weights_under_the_base_names(tiny_ckpt):
    trainer = TorchTrainer(tiny_ckpt, lora_cfg())
    samples = make_samples(8, seed=4)
    _step(trainer, samples)
    merged = dict(trainer.named_weights())
    base = load_file(str(tiny_ckpt / "model.safetensors"))
    assert merged.keys() == base.keys()
    params = dict(trainer.model.named_parameters())
    q = "model.layers.1.self_attn.q_proj"
    a, b = params[f"{q}.lora_A.default.weight"], params[f"{q}.lora_B.default.weight"]
    assert b.abs().max() > 0  # trained away from its zero start
    expected = base[f"{q}.weight"] + (8.0 / 4) * (b.detach() @ a.detach())  # W + alpha / r * B A
    torch.testing.assert_close(merged[f"{q}.weight"], expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(merged["model.norm.weight"], base["model.norm.weight"])  # not adapted: as it was
    # a plain model holding the merged weights computes the trainer's log-probs
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt)).eval()
    plain.load_state_dict(merged)
    lp = trainer.compute_log_probs(samples, ref=False)
    for s, mine in zip(samples, lp.old):
        torch.testing.assert_close(torch.tensor(mine), reference_log_probs(plain, s), atol=1e-5, rtol=0)


def test_checkpoint_is_a_merged_hf_folder_plus_a_peft_adapter_and_resumes_exactly(tiny_ckpt, tmp_path):
    config = lora_cfg(lora_target_modules=["q_proj", "v_proj"])
    trainer = TorchTrainer(tiny_ckpt, config)
    samples = make_samples(8, seed=5)
    _step(trainer, samples)
    trainer.save(tmp_path / "ckpt", {"k": 1})
    adapter = tmp_path / "ckpt" / ADAPTER_DIR
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["lora_alpha"] == 8.0 and set(saved["target_modules"]) == {"q_proj", "v_proj"}
    assert saved["base_model_name_or_path"] == str(tiny_ckpt)
    lp = trainer.compute_log_probs(samples, ref=False).old
    # PEFT loads the adapter onto the base and computes the trainer's log-probs
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_ckpt)), str(adapter)).eval()
    # the folder itself is a plain HF checkpoint of the merged model (what eval, serve and the engines read)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt")).eval()
    for s, mine in zip(samples, lp):
        torch.testing.assert_close(torch.tensor(mine), reference_log_probs(peft_model, s), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(mine), reference_log_probs(merged, s), atol=1e-5, rtol=0)
    # resume: a new trainer on the base takes the adapter, its optimizer and the step back, and steps as the first
    resumed = TorchTrainer(tiny_ckpt, config)
    assert resumed.load(tmp_path / "ckpt") == {"k": 1} and resumed.step == 1
    assert _max_diff(resumed.compute_log_probs(samples, ref=False).old, lp) == 0.0
    more = make_samples(8, seed=6)
    _step(trainer, more)
    _step(resumed, [s for s in make_samples(8, seed=6)])
    assert (
        _max_diff(resumed.compute_log_probs(samples, ref=False).old, trainer.compute_log_probs(samples, ref=False).old)
        < 1e-6
    )
    # a checkpoint of the other kind, an adapter of another rank or scale, or one trained on another base, is refused
    full = TorchTrainer(tiny_ckpt, cfg())
    with pytest.raises(ValueError, match="saved by a LoRA run"):
        full.load(tmp_path / "ckpt")
    full.save(tmp_path / "full")
    with pytest.raises(ValueError, match="no LoRA adapter"):
        TorchTrainer(tiny_ckpt, config).load(tmp_path / "full")
    qv = ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="r 4, this run's --lora-rank gives 2"):
        TorchTrainer(tiny_ckpt, lora_cfg(lora_rank=2, lora_target_modules=qv)).load(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="lora_alpha 8.0, this run's --lora-alpha gives 16.0"):
        TorchTrainer(tiny_ckpt, lora_cfg(lora_alpha=16.0, lora_target_modules=qv)).load(tmp_path / "ckpt")
    elsewhere = tmp_path / "the_same_weights_elsewhere"
    shutil.copytree(tiny_ckpt, elsewhere)
    with pytest.raises(ValueError, match="was trained on .*pass that base as --hf-checkpoint"):
        TorchTrainer(elsewhere, config).load(tmp_path / "ckpt")
    # an adapter of other modules is refused before anything of the trainer is replaced
    other = TorchTrainer(tiny_ckpt, lora_cfg())
    _step(other, make_samples(8, seed=9))
    state = {id(p): {k: v.clone() for k, v in st.items()} for p, st in other.optimizer.state.items()}
    weights = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(ValueError, match="adapts other modules"):
        other.load(tmp_path / "ckpt")
    assert state and {id(p) for p in other.optimizer.state} == set(state)
    assert all(torch.equal(v, state[id(p)][k]) for p, st in other.optimizer.state.items() for k, v in st.items())
    assert all(torch.equal(v, weights[k]) for k, v in other.model.state_dict().items())
    assert other.step == 1
    # --lora-adapter-path: a new run continues the saved adapter (a LoRA warm start's) on the same base
    warm = TorchTrainer(tiny_ckpt, lora_cfg(lora_target_modules=qv, lora_adapter_path=str(adapter)))
    assert _max_diff(warm.compute_log_probs(samples, ref=False).old, lp) < 1e-6 and warm.step == 0
    with pytest.raises(ValueError, match="was trained on"):
        TorchTrainer(elsewhere, lora_cfg(lora_target_modules=qv, lora_adapter_path=str(adapter)))


def test_all_linear_named_is_the_default(tiny_ckpt):
    named = TorchTrainer(tiny_ckpt, lora_cfg(lora_target_modules=["all-linear"]))
    default = TorchTrainer(tiny_ckpt, lora_cfg())
    trained = {n for n, p in default.model.named_parameters() if p.requires_grad}
    assert trained == {n for n, p in named.model.named_parameters() if p.requires_grad}
    assert not any("lm_head" in n for n in trained) and any("down_proj" in n for n in trained)


def test_gradient_checkpointing_and_packing_take_the_same_lora_step(tiny_ckpt):
    """Recomputed activations (frozen base, so the layers' inputs need no gradient) and packed rows: same step."""
    samples = make_samples(8, seed=8)
    plain = TorchTrainer(tiny_ckpt, lora_cfg())
    recompute = TorchTrainer(tiny_ckpt, lora_cfg(gradient_checkpointing=True, max_tokens_per_gpu=24))
    a, b = plain.train_step(samples), recompute.train_step(samples)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5) and a["grad_norm"] > 0
    lp_a, lp_b = plain.compute_log_probs(samples, ref=False), recompute.compute_log_probs(samples, ref=False)
    assert _max_diff(lp_a.old, lp_b.old) < 1e-5


def test_lean_activations_keep_the_adapted_mlps_and_take_the_same_step(tiny_ckpt):
    """The adapted SwiGLU MLPs keep gate and up once (the lean forward) and still run their LoRA layers."""
    samples = make_samples(8, seed=10)
    lean = TorchTrainer(tiny_ckpt, lora_cfg())
    own = TorchTrainer(tiny_ckpt, lora_cfg())
    assert lean.lean_modules == 7  # 5 RMSNorms and both layers' MLPs, whose projections are LoRA layers
    for m in own.model.modules():
        m.__dict__.pop("forward", None)  # each module's own forward again
    for _ in range(2):
        a, b = _step(lean, samples), _step(own, samples)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["grad_norm"] == pytest.approx(
            b["grad_norm"], rel=1e-5
        )
    assert (
        _max_diff(lean.compute_log_probs(samples, ref=False).old, own.compute_log_probs(samples, ref=False).old) < 1e-5
    )
    down = dict(lean.model.named_parameters())["model.layers.0.mlp.down_proj.lora_B.default.weight"]
    assert down.abs().max() > 0  # the down projection's adapter trained through the lean forward


def test_ppo_critic_trains_in_full_beside_a_lora_policy(tiny_ckpt):
    from agentrl.trainer.torch_critic import TorchCritic

    critic = TorchCritic(tiny_ckpt, lora_cfg(advantage_estimator="ppo"))
    assert critic.peft is None
    assert all(p.requires_grad for p in critic.model.parameters())


@pytest.mark.e2e
def test_trainer_group_fsdp2_lora_matches_single_rank(tiny_ckpt, tmp_path):
    """Two Ray actors sharding a LoRA model with FSDP2 over gloo: same log-probs, step, merged weights, resume."""
    ray = pytest.importorskip("ray")
    from agentrl.runtime.cluster import init_ray
    from agentrl.runtime.engine_group import numpy_to_tensors
    from agentrl.runtime.trainer_group import TrainerGroup

    started = not ray.is_initialized()
    init_ray(num_cpus=2)
    samples = make_samples(8, seed=15)
    config = lora_cfg(lr=1e-3, clip_grad=1.0, global_batch_size=4, num_steps_per_rollout=2, max_tokens_per_gpu=24)
    config = dataclasses.replace(config, use_kl_loss=True, kl_loss_coef=0.5)  # the reference: adapter off, sharded
    group = TrainerGroup(tiny_ckpt, config, world_size=2, num_cpus=1)
    try:
        single = TorchTrainer(tiny_ckpt, config)
        # the reference log-probs first, as the loop computes them (adapter off, on both shards), then the step
        lp_group, lp_single = group.compute_log_probs(samples, ref=True), single.compute_log_probs(samples, ref=True)
        assert lp_group.ref is not None and lp_single.ref is not None
        assert _max_diff(lp_group.ref, lp_single.ref) < 1e-5 and _max_diff(lp_group.old, lp_single.old) < 1e-5
        for s, old, ref in zip(samples, lp_single.old, lp_single.ref):
            s.old_log_probs, s.ref_log_probs = old, ref
        m_group, m_single = group.train_step(samples), single.train_step(samples)
        assert m_group["loss"] == pytest.approx(m_single["loss"], abs=1e-5)
        assert m_group["kl"] == pytest.approx(m_single["kl"], abs=1e-6) and m_single["kl"] != 0
        assert m_group["grad_norm"] == pytest.approx(m_single["grad_norm"], rel=1e-4)
        assert_group_weights_match(group, single)
        group.save(tmp_path / "ckpt", {"k": 2})
        single.save(tmp_path / "single")
        a = load_file(str(tmp_path / "ckpt" / ADAPTER_DIR / "adapter_model.safetensors"))
        b = load_file(str(tmp_path / "single" / ADAPTER_DIR / "adapter_model.safetensors"))
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0)
        group.train_step(samples[:4])
        stepped = numpy_to_tensors(ray.get(group.named_weights_ref()))
        assert group.load(tmp_path / "ckpt") == {"k": 2}
        group.train_step(samples[:4])
        for name, t in numpy_to_tensors(ray.get(group.named_weights_ref())).items():
            torch.testing.assert_close(t, stepped[name], atol=1e-6, rtol=0)
    finally:
        group.shutdown()
        if started:
            ray.shutdown()


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"lora_rank": -1}, "--lora-rank must be in"),
        ({"lora_rank": 4, "lora_alpha": 0.0}, "--lora-alpha must be > 0"),
        ({"lora_rank": 4, "lora_dropout": 1.0}, "--lora-dropout must be in"),
        ({"lora_alpha": 16.0}, "need --lora-rank"),
        ({"lora_target_modules": ["q_proj"]}, "need --lora-rank"),
        ({"lora_rank": 4, "lora_dropout": 0.1}, "--lora-dropout is for warm starts"),
        ({"lora_rank": 4, "lora_init": "pissa"}, "--lora-init must be default or gaussian"),
        ({"lora_rank": 4, "lora_alpha": float("inf")}, "--lora-alpha must be > 0"),
        ({"lora_rank": 4, "lora_alpha": True}, "--lora-alpha must be > 0"),
        ({"lora_rank": 4, "lora_target_modules": "q_proj"}, "--lora-target-modules must be a list of module names"),
        ({"lora_rank": 4, "lora_target_modules": ["q_proj", 3]}, "--lora-target-modules must be a list"),
        ({"lora_rank": 4, "lora_target_modules": ["../x"]}, "--lora-target-modules must be a list"),
        ({"lora_adapter_path": "/tmp/a"}, "need --lora-rank"),
    ],
)
def test_bad_lora_values_are_refused_naming_the_flag(kw, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kw).validate()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({}, "it needs --lora-rank"),
        ({"train": {"lora_rank": 4, "lora_target_modules": ["q_proj", "lm_head"]}}, r"\['lm_head'\] given otherwise"),
        ({"train": {"lora_rank": 4}, "engine_url": ["http://127.0.0.1:1"]}, "not --engine-url"),
        (
            {"train": {"lora_rank": 4}, "rollout_backend": "sglang", "colocate": True},
            "--weight-sync adapter with --rollout-backend sglang --colocate: not supported yet",
        ),
        (
            {"train": {"lora_rank": 4}, "rollout_backend": "sglang", "sglang_args": {"max_lora_rank": 64}},
            "--sglang-max-lora-rank: --weight-sync adapter sets the launched servers' LoRA flags",
        ),
        (
            {"train": {"lora_rank": 4}, "rollout_backend": "sglang", "sglang_args": {"dp_size": 2}},
            "--sglang-dp-size > 1: SGLang loads adapters by name with one data-parallel rank only",
        ),
    ],
)
def test_weight_sync_adapter_is_refused_where_no_engine_could_serve_the_adapter(tmp_path, kw, message):
    from tests.test_train import _cfg

    with pytest.raises(ValueError, match=message):
        _cfg("/m", tmp_path, weight_sync="adapter", **kw).validate()


def test_lora_dropout_is_accepted_for_a_warm_start():
    TrainConfig(lora_rank=4, lora_dropout=0.1, loss_type="sft_loss").validate()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"lora_target_modules": ["qq_proj"]}, "--lora-target-modules qq_proj: the model has no such module"),
        ({"lora_target_modules": ["embed_tokens"]}, "adapts linear layers, not Embedding"),
        ({"lora_target_modules": ["all-linear", "q_proj"]}, "all-linear stands alone"),
        ({"lora_rank": 100}, "--lora-rank 100 is above the rank of every adapted layer"),
    ],
)
def test_lora_flags_the_model_cannot_take_are_refused_before_weights_load(tiny_ckpt, kw, message):
    with pytest.raises(ValueError, match=message):
        check_lora(tiny_ckpt, TrainConfig(**{"lora_rank": 4, **kw}))
    with pytest.raises(ValueError, match=message):  # and the trainer says the same
        TorchTrainer(tiny_ckpt, TrainConfig(**{"lora_rank": 4, **kw}))


def test_an_adapter_on_a_tied_lm_head_is_refused(tied_ckpt):
    with pytest.raises(ValueError, match="ties its LM head to its input embeddings"):
        check_lora(tied_ckpt, TrainConfig(lora_rank=4, lora_target_modules=["lm_head"]))
    check_lora(tied_ckpt, TrainConfig(lora_rank=4))  # all-linear leaves the head out


def test_an_adapted_untied_lm_head_merges_into_the_head(tiny_ckpt):
    trainer = TorchTrainer(tiny_ckpt, lora_cfg(lora_target_modules=["lm_head"], loss_type="sft_loss"))
    samples = make_samples(8, seed=7)
    losses = [trainer.train_step(samples)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0]
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt)).eval()
    plain.load_state_dict(dict(trainer.named_weights()))
    lp = trainer.compute_log_probs(samples, ref=False)
    for s, mine in zip(samples, lp.old):
        torch.testing.assert_close(torch.tensor(mine), reference_log_probs(plain, s), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- end to end


@pytest.mark.e2e
def test_agentrl_train_with_lora_serves_the_adapter_and_resumes(tiny_ckpt, tmp_path, ray_local, capsys):
    """A LoRA run on the embedded engine with --weight-sync adapter: each step's engine serves the adapted policy,
    pushed as the adapter alone on the engine's unchanged base (the trainer's log-probs of the sampled tokens match
    the engine's: --true-on-policy-mode), checkpoints carry the adapter, --load resumes. (The merged-weights push of a
    LoRA run is the SFT -> RL test's, below.)"""
    from agentrl.runtime.train import train
    from tests.test_train import _cfg, _lines

    save = tmp_path / "run"
    lora = {"lora_rank": 4, "lr": 2e-2, "use_kl_loss": True, "kl_loss_coef": 0.1}
    adapter = {"weight_sync": "adapter"}
    summary = train(
        _cfg(tiny_ckpt, save, num_rollout=3, save_interval=1, true_on_policy_mode=True, train=lora, **adapter)
    )
    assert summary["weight_version"] == 3
    assert summary["weight_sync"] == ["adapter"]  # the engines got the adapter alone, on their unchanged base
    lines = _lines(save)
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert all(line["true_on_policy_logprob_diff_max"] < 1e-3 for line in lines)  # the engine serves the adapter
    assert lines[-1]["kl"] != 0.0  # the adapter moved the policy away from the base
    last = save / "iter_0000003"
    merged = load_file(str(last / "model.safetensors"))
    base = load_file(str(tiny_ckpt / "model.safetensors"))
    assert any(not torch.equal(merged[k], base[k]) for k in base)
    assert (last / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    # resuming it as a full fine-tuning run, or with another rank, is refused before anything starts
    from agentrl.cli import main

    flags = ["train", "--env", "agentrl.envs.digits:Digits", "--hf-checkpoint", str(tiny_ckpt), "--load", str(save)]
    assert main(flags) == 2
    assert "was saved by a LoRA run" in capsys.readouterr().err
    assert main([*flags, "--lora-rank", "8"]) == 2
    assert "its adapter has r 4, this run's --lora-rank gives 8" in capsys.readouterr().err
    summary = train(
        _cfg(
            tiny_ckpt,
            save,
            num_rollout=4,
            save_interval=1,
            true_on_policy_mode=True,
            train=lora,
            load=str(save),
            **adapter,
        )
    )
    assert summary["weight_version"] == 4
    lines = _lines(save)
    assert [line["step"] for line in lines] == [0, 1, 2, 3]  # resumed after step 2, on the adapted engine
    assert lines[-1]["true_on_policy_logprob_diff_max"] < 1e-3


@pytest.mark.e2e
@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_weight_sync_adapter_on_launched_servers_loads_it_by_name(tiny_ckpt, tmp_path, ray_local, async_mode):
    """--rollout-backend sglang (launched `agentrl serve`, SGLang's API): the servers start with SGLang's LoRA flags,
    each push writes the adapter as a PEFT folder that every server loads by name through SGLang's own endpoints
    (/unload_lora_adapter, /load_lora_adapter, /update_weight_version), every request names it (lora_path), and the
    engine's log-probs of the sampled tokens equal the trainer's (--true-on-policy-mode); a server killed between steps
    comes back serving the adapter. Async: episodes in flight during a push lose nothing (the swap is paused around)."""
    import os
    import signal

    import httpx

    from agentrl.runtime.train import _Runtime, train
    from tests.test_train import _cfg, _dump, _lines

    save = tmp_path / "run"
    lora = {"lora_rank": 4, "lr": 2e-2, "use_kl_loss": True, "kl_loss_coef": 0.1}
    kw = dict(
        rollout_backend="sglang",
        sglang_launcher="agentrl",
        weight_sync="adapter",
        train=lora,
        **({"async_mode": True} if async_mode else {"true_on_policy_mode": True}),
    )
    killed, served = [], []
    sync = _Runtime.sync_weights

    def kill_then_sync(self, version):  # the server dies between steps: the monitor restarts it, it reloads
        if version == 2 and not killed:
            pid = self.engines.pids()[0]
            os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
            assert self.engines.check_and_restart() == [0]
            url, headers = self.engines.urls[0], self.engines.launch.headers
            models = httpx.get(url + "/v1/models", headers=headers).json()["data"]
            version_now = httpx.get(url + "/get_weight_version", headers=headers).json()["weight_version"]
            served.append((version_now, "policy" in {m["id"] for m in models}))
        return sync(self, version)

    _Runtime.sync_weights = kill_then_sync
    try:
        summary = train(_cfg(tiny_ckpt, save, num_rollout=3, **kw))
    finally:
        _Runtime.sync_weights = sync
    assert killed and summary["weight_sync"] == ["adapter"] and summary["weight_version"] == 3
    lines = _lines(save)
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert all(line["count_failed"] == 0 for line in lines)  # no request met a server without the adapter
    assert lines[-1]["kl"] != 0.0  # the adapter moved away from the base
    if not async_mode:
        assert all(line["true_on_policy_logprob_diff_max"] < 1e-3 for line in lines)  # the servers serve the adapter
        for step in range(3):  # version 0 (the fresh adapter, loaded before the first request), then each push
            assert {v for s in _dump(save, step) for v in s["weight_versions"]} == {str(step)}
    folders = sorted(p.name for p in (save / "weight_sync").iterdir())
    assert folders == ["adapter-3"]  # the latest stays for a restarted server; older ones are removed
    assert served == [("1", True)]  # the restarted server reloaded the recorded adapter and its version


@pytest.mark.e2e
def test_agentrl_sft_with_lora_writes_an_adapter_rl_starts_from(tiny_ckpt, tmp_path, ray_local, capsys):
    from agentrl.cli import main
    from agentrl.envs.calculator import Calculator

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in Calculator.tasks(8, seed=5)))
    save = tmp_path / "warm"
    flags = ["--env", "agentrl.envs.calculator:Calculator", "--prompt-data", str(tasks), "--max-turns", "2"]
    flags += ["--rollout-max-turn-len", "48", "--global-batch-size", "8"]
    rc = main(
        ["sft", *flags, "--hf-checkpoint", str(tiny_ckpt), "--demo-policy", "agentrl.envs.calculator:solver_policy"]
        + ["--num-epoch", "30", "--lr", "2e-2", "--lora-rank", "8", "--lora-dropout", "0.05", "--save", str(save)]
        # the tiny model's next token is mostly its LM head's doing: adapt it too (all-linear leaves it out)
        + [f"--lora-target-modules={m}" for m in ("q_proj", "v_proj", "up_proj", "down_proj", "lm_head")]
    )
    assert rc == 0, capsys.readouterr().err
    lines = [json.loads(x) for x in open(save / "metrics.jsonl")]
    assert lines[-1]["sft_loss"] < 0.75 * lines[0]["sft_loss"]  # 5.9 -> 3.7 when written
    saved = json.loads((save / "iter_0000030" / ADAPTER_DIR / "adapter_config.json").read_text())
    assert saved["r"] == 8 and saved["lora_dropout"] == 0.05 and "lm_head" in saved["target_modules"]
    # RL continues the warm start's adapter on the same base (--lora-adapter-path): its first rollout is sampled
    # from the warm start (the engine got base + adapter), and its checkpoint's adapter moved on from there
    rl = tmp_path / "rl"
    targets = [f"--lora-target-modules={m}" for m in ("q_proj", "v_proj", "up_proj", "down_proj", "lm_head")]
    warm_adapter = save / "iter_0000030" / ADAPTER_DIR
    rc = main(
        ["train", *flags, "--hf-checkpoint", str(tiny_ckpt), "--num-rollout", "1", "--rollout-batch-size", "2"]
        + ["--n-samples-per-prompt", "4", "--lora-rank", "8", *targets, "--lora-adapter-path", str(warm_adapter)]
        # (an entropy bonus: a gradient even when every episode of a group ties)
        + ["--lr", "1e-2", "--entropy-coef", "0.01", "--true-on-policy-mode", "--save", str(rl)]
    )
    assert rc == 0, capsys.readouterr().err
    (line,) = [json.loads(x) for x in open(rl / "metrics.jsonl")]
    assert line["true_on_policy_logprob_diff_max"] < 1e-3  # the engine served base + the warm start's adapter
    a = load_file(str(warm_adapter / "adapter_model.safetensors"))
    b = load_file(str(rl / "iter_0000001" / ADAPTER_DIR / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
    # the same adapter on another base, or with another rank, is refused before anything starts
    rc = main(
        ["train", *flags, "--hf-checkpoint", str(save / "iter_0000030"), "--lora-rank", "8", *targets]
        + ["--lora-adapter-path", str(warm_adapter), "--save", str(tmp_path / "refused")]
    )
    assert rc == 2 and "pass that base as --hf-checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_lora_flags_are_refused_by_the_cli_before_anything_starts(tiny_ckpt, tmp_path, capsys):
    from agentrl.cli import main

    base = ["train", "--env", "agentrl.envs.digits:Digits", "--hf-checkpoint", str(tiny_ckpt)]
    assert main([*base, "--lora-rank", "4", "--lora-target-modules", "qq_proj", "--save", str(tmp_path / "a")]) == 2
    assert "--lora-target-modules qq_proj: the model has no such module" in capsys.readouterr().err
    assert main([*base, "--lora-alpha", "16", "--save", str(tmp_path / "b")]) == 2
    assert "need --lora-rank" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("launcher", ["sglang", "agentrl"])
def test_weight_sync_adapter_on_launched_servers_passes_sglangs_lora_flags(tmp_path, launcher):
    """The launched servers of a --weight-sync adapter run start with SGLang's LoRA flags, and every request of the
    run names the policy's adapter (SGLang has no adapter served to requests that name none)."""
    from agentrl.engines.sglang import build_launch_command
    from agentrl.runtime.backends import sglang_launch
    from tests.test_train import _cfg

    train = {"lora_rank": 8, "lora_target_modules": ["q_proj", "v_proj"]}
    cfg = _cfg("/m", tmp_path, weight_sync="adapter", rollout_backend="sglang", sglang_launcher=launcher, train=train)
    cfg.validate()
    assert cfg.policy_lora_path == "policy"
    argv = build_launch_command(sglang_launch(cfg, "/m"), port=30000)
    flags = " ".join(argv)
    assert "--enable-lora" in argv and "--max-lora-rank 8" in flags and "--lora-target-modules q_proj v_proj" in flags
    assert _cfg("/m", tmp_path, weight_sync="adapter", train=train).policy_lora_path is None  # embedded: by default
    plain = _cfg("/m", tmp_path, rollout_backend="sglang", sglang_launcher=launcher)
    assert plain.policy_lora_path is None and "--enable-lora" not in build_launch_command(
        sglang_launch(plain, "/m"), port=1
    )


def test_custom_generate_functions_are_given_the_adapter_requests_must_name():
    """slime-style functions that post /generate themselves read args.lora_path (None: the engines' default)."""
    import argparse

    from agentrl.engines.http import SGLangEngine
    from agentrl.engines.router import Router
    from agentrl.rollout.generate import bind_engine_args

    url = "http://127.0.0.1:1"  # no request is sent
    args = argparse.Namespace()
    bind_engine_args(args, Router([SGLangEngine(url, lora_path="policy")]), None, None, [url])
    assert args.lora_path == "policy"
    bind_engine_args(args, Router([SGLangEngine(url)]), None, None, [url])
    assert args.lora_path is None
