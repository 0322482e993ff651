"""The torch trainer backend: packing, the policy step, gradient accumulation, checkpoints, FSDP2 via Ray.

All on the tiny 2-layer Llama (hidden 64) in fp32 on CPU. The Ray test starts two actors that shard
the model with FSDP2 over gloo and must produce the same update as one unsharded rank.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from agentrl.config import TrainConfig
from agentrl.trainer.base import TrainSample
from agentrl.trainer.batching import pack_micro_batches, pack_samples
from agentrl.trainer.torch_trainer import TorchTrainer

VOCAB = 300


def make_samples(n: int, seed: int = 0, *, adv: float | None = None) -> list[TrainSample]:
    """Random prompts/responses of varying lengths, some masked-out tokens, varied advantages."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, r = rng.randint(3, 9), rng.randint(2, 12)
        mask = [1] * r
        if r > 4:
            mask[rng.randrange(r)] = 0  # an env-written token inside the response
        a = adv if adv is not None else rng.choice([-1.0, 0.5, 1.5])
        out.append(
            TrainSample(
                tokens=[rng.randrange(VOCAB) for _ in range(p + r)],
                response_length=r,
                loss_mask=mask,
                advantages=[a] * r,
            )
        )
    return out


def cfg(**kw) -> TrainConfig:
    base = dict(lr=1e-3, clip_grad=0.0, global_batch_size=8, max_tokens_per_gpu=4096, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def reference_log_probs(model, sample: TrainSample) -> torch.Tensor:
    """Plain HF forward of one sample alone: log p(response token j | everything before it)."""
    ids = torch.tensor([sample.tokens])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
    p = sample.prompt_length
    return logp[p - 1 : -1].gather(1, ids[0, p:, None])[:, 0]


def capture_grads(trainer: TorchTrainer) -> list[dict[str, torch.Tensor]]:
    """Record the gradients each optimizer step sees (then take the real step)."""
    seen: list[dict[str, torch.Tensor]] = []
    real_step = trainer.optimizer.step

    def step(*a, **k):
        seen.append({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return real_step(*a, **k)

    trainer.optimizer.step = step
    return seen


def assert_group_weights_match(group, single: TorchTrainer) -> None:
    """A sharded trainer group's full weights (gathered, as the engines get them) equal one rank's."""
    import ray

    from agentrl.runtime.engine_group import numpy_to_tensors

    weights = numpy_to_tensors(ray.get(group.named_weights_ref()))
    expected = dict(single.named_weights())
    assert weights.keys() == expected.keys()
    for name, t in expected.items():
        torch.testing.assert_close(weights[name], t, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- packing


def test_pack_micro_batches_respects_budget_and_is_deterministic():
    rng = random.Random(1)
    lengths = [rng.randint(1, 60) for _ in range(200)] + [150, 99]
    groups = pack_micro_batches(lengths, 100)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        total = sum(lengths[i] for i in g)
        assert total <= 100 or len(g) == 1  # over budget only when a sample alone is
        assert g == sorted(g)
    assert [len(lengths) - 2] in groups  # the 150-token sample sits alone
    assert groups == pack_micro_batches(lengths, 100)
    assert len(groups) <= sum(lengths) / 100 * 11 / 9 + 2  # FFD bound
    assert pack_micro_batches([], 10) == []


def test_pack_samples_alignment():
    s = [
        TrainSample(tokens=[5, 6, 7, 8], response_length=2, loss_mask=[1, 0], advantages=[1.0, 2.0]),
        TrainSample(tokens=[9, 10, 11], response_length=1, loss_mask=[1], advantages=[3.0]),
    ]
    b = pack_samples(s)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert b.logit_positions.tolist() == [1, 2, 5]  # logits at p predict token p + 1
    assert b.targets.tolist() == [7, 8, 11]
    assert b.seq_ids.tolist() == [0, 0, 1]
    assert b.mask.tolist() == [1.0, 0.0, 1.0]
    assert b.old_log_probs is None
    assert b.split(torch.tensor([0.5, 0.25, 2.0])) == [[0.5, 0.25], [2.0]]
    with pytest.raises(ValueError, match="prompt token"):
        pack_samples([TrainSample(tokens=[1, 2], response_length=2, loss_mask=[1, 1])])


def test_packed_log_probs_equal_alone(tiny_ckpt):
    """Samples packed in one row must not see each other: log-probs equal the sample run alone."""
    trainer = TorchTrainer(tiny_ckpt, cfg())
    assert not trainer.explicit_mask  # transformers detects restarting position_ids itself
    samples = make_samples(6, seed=3)
    assert len(pack_micro_batches([len(s.tokens) for s in samples], 4096)) == 1
    packed = trainer.compute_log_probs(samples, ref=False).old
    trainer.explicit_mask = True  # the fallback path for models that would not
    explicit = trainer.compute_log_probs(samples, ref=False).old
    for s, lp, ex in zip(samples, packed, explicit):
        alone = reference_log_probs(trainer.model, s)
        torch.testing.assert_close(torch.tensor(lp), alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(ex), alone, atol=1e-5, rtol=0)


def test_packing_check_catches_a_model_that_ignores_position_ids(tiny_ckpt):
    """A model that attends across packed samples (here: a 2-D mask disables HF's detection) is caught."""
    from agentrl.trainer.torch_trainer import _packing_is_isolated, load_causal_lm

    class AttendsAcross(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def forward(self, input_ids, attention_mask=None, **kw):
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kw)

    model = load_causal_lm(tiny_ckpt, torch.float32, torch.device("cpu"))
    assert _packing_is_isolated(model, torch.device("cpu"))
    assert not _packing_is_isolated(AttendsAcross(model), torch.device("cpu"))


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_train_step_moves_log_prob_with_advantage_sign(tiny_ckpt, sign):
    trainer = TorchTrainer(tiny_ckpt, cfg(lr=3e-3, clip_grad=1.0, num_steps_per_rollout=2))
    samples = make_samples(4, seed=5, adv=sign)
    for s in samples:
        s.loss_mask = [1] * s.response_length
    before = trainer.compute_log_probs(samples, ref=False).old
    metrics = trainer.train_step(samples)
    after = trainer.compute_log_probs(samples, ref=False).old
    delta = sum(sum(a) - sum(b) for a, b in zip(after, before))
    assert delta * sign > 0.1
    assert metrics["steps"] == 2 and trainer.step == 2
    assert metrics["train_tokens"] == sum(s.response_length for s in samples)
    for key in ("loss", "pg_loss", "kl", "entropy", "clipfrac", "grad_norm", "lr", "tokens_per_s", "train_seconds"):
        assert key in metrics
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 0


def test_the_trainer_knows_whether_its_weights_are_finite(tiny_ckpt, tmp_path):
    """The torch trainer checks its weights where they change (load, each optimizer step), so the
    shared-memory push need not read every byte again (bench P5); a NaN that reaches a weight clears it."""
    trainer = TorchTrainer(tiny_ckpt, cfg(lr=1e-3))
    assert trainer.weights_finite
    samples = make_samples(4, seed=1)
    trainer.train_step(samples)
    assert trainer.weights_finite
    trainer.save(tmp_path / "ok")
    with torch.no_grad():
        next(iter(trainer.model.parameters())).view(-1)[0] = float("nan")
    trainer.train_step(samples)  # AdamW carries the NaN on: the step's check sees it
    assert not trainer.weights_finite
    trainer.load(tmp_path / "ok")
    assert trainer.weights_finite


@pytest.mark.parametrize("per_token", [True, False])
def test_gradient_accumulation_equals_one_micro_batch(tiny_ckpt, per_token):
    """Tiny token budget (one sample per micro-batch) gives the gradients of one big micro-batch."""
    samples = make_samples(6, seed=7)
    old = TorchTrainer(tiny_ckpt, cfg()).compute_log_probs(samples, ref=False).old
    for i, (s, lp) in enumerate(zip(samples, old)):  # ratio != 1 (some clipped) so clipping must agree too
        s.old_log_probs = [v + (0.05 if i % 2 else -0.01) for v in lp]
    grads, norms = [], []
    for budget in (16, 4096):
        trainer = TorchTrainer(
            tiny_ckpt, cfg(calculate_per_token_loss=per_token, max_tokens_per_gpu=budget, eps_clip=0.03)
        )
        seen = capture_grads(trainer)
        n_micro = len(pack_micro_batches([len(s.tokens) for s in samples], budget))
        assert n_micro >= 4 if budget == 16 else n_micro == 1
        norms.append(trainer.train_step(samples)["grad_norm"])
        grads.append(seen[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4)
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


def test_gradient_checkpointing_same_step(tiny_ckpt):
    samples = make_samples(4, seed=9)
    metrics = [TorchTrainer(tiny_ckpt, cfg(gradient_checkpointing=gc)).train_step(samples) for gc in (False, True)]
    assert metrics[0]["grad_norm"] == pytest.approx(metrics[1]["grad_norm"], rel=1e-5)
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], abs=1e-6)


def test_bf16_compute_keeps_fp32_weights(tiny_ckpt):
    """dtype=bfloat16 is autocast compute: weights and optimizer state stay fp32, log-probs stay close."""
    samples = make_samples(3, seed=4)
    exact = TorchTrainer(tiny_ckpt, cfg()).compute_log_probs(samples, ref=False).old
    trainer = TorchTrainer(tiny_ckpt, cfg(dtype="bfloat16", lr=1e-6))
    before = trainer.model.lm_head.weight.detach().clone()
    for explicit in (False, True):
        trainer.explicit_mask = explicit
        approx = trainer.compute_log_probs(samples, ref=False).old
        for a, b in zip(exact, approx):
            torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=0.05, rtol=0)
    trainer.train_step(samples)
    assert trainer.model.lm_head.weight.dtype == torch.float32
    assert (trainer.model.lm_head.weight - before).abs().max() > 0  # a 1e-6 step is not lost


def test_kl_reference_model(tiny_ckpt):
    trainer = TorchTrainer(tiny_ckpt, cfg(lr=3e-3, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3"))
    samples = make_samples(4, seed=11, adv=1.0)
    lp = trainer.compute_log_probs(samples, ref=True)
    for a, b in zip(lp.old, lp.ref):  # same weights at the start
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=0)
    assert trainer.train_step(samples)["kl"] == pytest.approx(0.0, abs=1e-6)
    # second step: ref log-probs computed on the fly (none attached), policy has moved away
    m = trainer.train_step(samples)
    assert m["kl"] > 0
    lp2 = trainer.compute_log_probs(samples, ref=True)
    for a, b in zip(lp.ref, lp2.ref):  # the reference model is frozen
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=0)
    assert not all(torch.allclose(torch.tensor(a), torch.tensor(b)) for a, b in zip(lp.old, lp2.old))
    with pytest.raises(ValueError, match="--use-kl-loss or --kl-coef"):
        TorchTrainer(tiny_ckpt, cfg()).compute_log_probs(samples, ref=True)


# ---------------------------------------------------------------- checkpoints


def test_save_load_resume(tied_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first, second = make_samples(4, seed=1), make_samples(4, seed=2)
    a = TorchTrainer(tied_ckpt, cfg(lr=1e-2))
    a.train_step(first)
    a.save(tmp_path / "ckpt", extra_state={"rollout_id": 7})

    weights = dict(a.named_weights())
    assert "lm_head.weight" not in weights  # tied: written once, as HF does
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    for name, t in loaded.state_dict().items():
        key = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        torch.testing.assert_close(t, weights[key], atol=0, rtol=0)
    AutoTokenizer.from_pretrained(tmp_path / "ckpt")  # the tokenizer came along
    assert (tmp_path / "ckpt" / "optim_rank0.pt").exists() and (tmp_path / "ckpt" / "trainer_state.pt").exists()

    b = TorchTrainer(tied_ckpt, cfg(lr=1e-2))
    assert b.load(tmp_path / "ckpt") == {"rollout_id": 7}
    assert b.step == 1
    torch.manual_seed(123)
    ma = a.train_step(second)
    torch.manual_seed(123)
    mb = b.train_step(second)
    assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-6)
    for (na, ta), (nb, tb) in zip(a.named_weights(), b.named_weights()):
        assert na == nb
        torch.testing.assert_close(ta, tb, atol=1e-6, rtol=0)
    assert b.model.lm_head.weight is b.model.model.embed_tokens.weight


def test_resident_state_steps_as_freed_gradients_and_the_per_tensor_adamw(tiny_ckpt, tmp_path):
    a = TorchTrainer(tiny_ckpt, cfg(lr=1e-2, weight_decay=0.1))  # the CPU, one-process default
    assert a.keep_grads and a.optimizer.param_groups[0]["fused"] is True
    params = [p for p in a.model.parameters() if p.requires_grad]
    assert all(p.grad is not None and not p.grad.any() for p in params)  # allocated at load
    assert all(set(a.optimizer.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in params)
    b = TorchTrainer(tiny_ckpt, cfg(lr=1e-2, weight_decay=0.1), resident_state=False)  # as before
    assert not b.optimizer.state and all(p.grad is None for p in b.model.parameters())
    start = [p.detach().clone() for p in a.model.parameters()]
    for seed in (1, 2, 3):
        batch = make_samples(4, seed=seed)
        torch.manual_seed(0)
        ma = a.train_step(batch)
        torch.manual_seed(0)
        mb = b.train_step(batch)
        assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-6)
    assert all(p.grad is not None for p in a.model.parameters())  # zeroed at the next step, never freed
    assert all(p.grad is None for p in b.model.parameters())
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):  # within 1% of one step's size (lr):
        torch.testing.assert_close(pa, pb, atol=1e-4, rtol=0)  # the two kernels round differently
    assert [float(a.optimizer.state[p]["step"]) for p in params] == [3.0] * len(params)
    assert max(float((pa - p0).abs().max()) for p0, pa in zip(start, a.model.parameters())) > 1e-3

    # a checkpoint of the per-tensor AdamW resumes on the fused one, and steps on as the per-tensor one does
    b.save(tmp_path / "ckpt")
    c = TorchTrainer(tiny_ckpt, cfg(lr=1e-2, weight_decay=0.1))
    c.load(tmp_path / "ckpt")
    assert c.optimizer.param_groups[0]["fused"] is True
    batch = make_samples(4, seed=4)
    b.train_step(batch)
    c.train_step(batch)
    for pb, pc in zip(b.model.parameters(), c.model.parameters()):
        torch.testing.assert_close(pc, pb, atol=1e-4, rtol=0)


def test_resident_state_is_refused_where_it_was_not_measured_and_a_partial_checkpoint_changes_nothing(
    tiny_ckpt, tmp_path
):
    with pytest.raises(TypeError, match="resident_state must be True, False or None"):
        TorchTrainer(tiny_ckpt, cfg(), resident_state="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="resident_state=True is for a CPU trainer in one process"):
        TorchTrainer(tiny_ckpt, cfg(), resident_state=True, device="meta")
    t = TorchTrainer(tiny_ckpt, cfg(lr=1e-2))
    t.train_step(make_samples(4, seed=1))
    t.save(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "optim_rank0.pt").unlink()
    moments = {id(p): dict(s) for p, s in t.optimizer.state.items()}
    with pytest.raises(FileNotFoundError, match="optim_rank0.pt is missing"):
        t.load(tmp_path / "ckpt")
    assert {id(p): dict(s) for p, s in t.optimizer.state.items()} == moments  # the same tensors, untouched


def test_a_parameter_no_backward_reached_is_not_stepped_though_its_gradient_was_kept(tiny_ckpt):
    t = TorchTrainer(tiny_ckpt, cfg(lr=1e-2, weight_decay=0.1))
    t.train_step(make_samples(4, seed=1))
    # like an expert no token was routed to in this step: it holds a (kept) gradient from an earlier one
    unrouted = torch.nn.Parameter(torch.ones(3))
    t.model.register_parameter("unrouted", unrouted)
    t.optimizer.add_param_group({"params": [unrouted]})
    unrouted.grad = torch.full((3,), 0.5)
    embed = t.model.get_input_embeddings().weight.detach().clone()
    t.train_step(make_samples(4, seed=2))
    # AdamW skipped it, as with freed gradients (a zeroed gradient would still decay it by lr x 0.1)
    assert torch.equal(unrouted.detach(), torch.ones(3)) and unrouted.grad is None
    assert not torch.equal(t.model.get_input_embeddings().weight, embed)  # the step itself ran


# ---------------------------------------------------------------- Ray + FSDP2


def test_token_balanced_shards():
    from agentrl.runtime.trainer_group import _token_balanced_bounds

    assert _token_balanced_bounds([10] * 8, 2) == [(0, 4), (4, 8)]
    assert _token_balanced_bounds([30, 10, 10, 10], 2) == [(0, 1), (1, 4)]
    assert _token_balanced_bounds([5], 3) == [(0, 0), (0, 1), (1, 1)]  # empty shards are fine
    bounds = _token_balanced_bounds(list(range(1, 30)), 4)
    assert bounds[0][0] == 0 and bounds[-1][1] == 29 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


@pytest.mark.e2e
def test_trainer_group_fsdp2_matches_single_rank(tiny_ckpt, tmp_path):
    """Two Ray actors sharding with FSDP2 over gloo take the same step as one unsharded rank (< 40 s)."""
    ray = pytest.importorskip("ray")
    from agentrl.runtime.cluster import init_ray
    from agentrl.runtime.trainer_group import TrainerGroup

    started = not ray.is_initialized()
    init_ray(num_cpus=2)
    t0 = time.perf_counter()
    samples = make_samples(8, seed=15)  # at budget 24, each step's two shards pack into 1 and 2 micro-batches
    # lr small: Adam's update g / (|g| + 1e-8) amplifies float-summation-order noise where |g| ~ 1e-8;
    # the scale-sensitive checks are the loss and grad_norm (Adam itself is invariant to grad scale)
    config = cfg(lr=1e-3, clip_grad=1.0, global_batch_size=4, num_steps_per_rollout=2, max_tokens_per_gpu=24)
    group = TrainerGroup(tiny_ckpt, config, world_size=2, num_cpus=1)
    try:
        single = TorchTrainer(tiny_ckpt, config)
        lp_group, lp_single = group.compute_log_probs(samples), single.compute_log_probs(samples, ref=False)
        for a, b in zip(lp_group.old, lp_single.old):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
        one = group.compute_log_probs(samples[:1])  # rank 1 has nothing: it runs empty passes
        torch.testing.assert_close(torch.tensor(one.old[0]), torch.tensor(lp_single.old[0]), atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="multiple"):
            group.train_step(samples[:6])
        m_group = group.train_step(samples)
        m_single = single.train_step(samples)
        assert m_group["train_tokens"] == m_single["train_tokens"]
        assert m_group["loss"] == pytest.approx(m_single["loss"], abs=1e-5)
        assert m_group["grad_norm"] == pytest.approx(m_single["grad_norm"], rel=1e-4)
        from agentrl.runtime.engine_group import numpy_to_tensors

        assert_group_weights_match(group, single)
        group.save(tmp_path / "ckpt", {"k": 1})
        assert (tmp_path / "ckpt" / "optim_rank1.pt").exists()
        group.train_step(samples[:4])
        resumed = numpy_to_tensors(ray.get(group.named_weights_ref()))
        assert group.load(tmp_path / "ckpt") == {"k": 1}  # sharded weights + optimizer shards back
        group.train_step(samples[:4])
        for name, t in numpy_to_tensors(ray.get(group.named_weights_ref())).items():
            torch.testing.assert_close(t, resumed[name], atol=1e-6, rtol=0)
    finally:
        group.shutdown()
        if started:
            ray.shutdown()
    print(f"ray fsdp2 test body: {time.perf_counter() - t0:.1f}s")


def test_packed_attention_matches_separate_forwards_and_falls_back(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    from agentrl.trainer import packed_attention

    plain = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    packed = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    assert packed_attention.enable(packed)  # the tiny model uses grouped-query attention (4 heads, 2 kv)
    lens = [7, 12, 5]
    ids = torch.randint(0, 300, (1, sum(lens)), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with packed_attention.segments(pos):
        out = packed(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    alone = torch.cat([plain(input_ids=part, use_cache=False).logits[0] for part in ids.split(lens, dim=1)])
    torch.testing.assert_close(out, alone, atol=1e-5, rtol=0)
    # outside a segments block it is plain SDPA (here: one causal sequence)
    torch.testing.assert_close(
        packed(input_ids=ids, use_cache=False).logits, plain(input_ids=ids, use_cache=False).logits
    )


# ---------------------------------------------------------------- samples without a gradient


def test_with_gradient_keeps_only_samples_that_can_move_the_weights():
    from agentrl.trainer.base import with_gradient

    live = TrainSample(tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1], advantages=[0.0, 0.5])
    tied = TrainSample(tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1], advantages=[0.0, 0.0])
    env_only = TrainSample(tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 0], advantages=[0.0, 2.0])
    assert with_gradient([live, tied, env_only], cfg()) == [live]  # an advantage on a mask-0 token trains nothing
    for kw in (dict(loss_type="sft_loss"), dict(use_kl_loss=True), dict(entropy_coef=0.01)):
        assert with_gradient([live, tied, env_only], cfg(**kw)) == [live, tied, env_only], kw


@pytest.mark.parametrize("per_token", [True, False])
def test_zero_advantage_samples_skip_the_model_and_leave_the_step_unchanged(tiny_ckpt, monkeypatch, per_token):
    """A tied group's samples (advantage 0) get no forward/backward; the weights move exactly as over all.

    Step 1 has half its samples at advantage 0; step 2 has only such samples, where AdamW must still
    step (its moments and weight decay move the weights) as it does over the full batch.
    """
    from agentrl.trainer import torch_trainer

    step1 = make_samples(8, seed=11)
    for s in step1[::2]:
        s.advantages = [0.0] * s.response_length
    step2 = make_samples(4, seed=12, adv=0.0)
    runs = {}
    for mode in ("skip", "full", "live only"):
        if mode == "full":
            monkeypatch.setattr(torch_trainer, "with_gradient", lambda samples, c: list(samples))
        trainer = TorchTrainer(tiny_ckpt, cfg(calculate_per_token_loss=per_token, weight_decay=0.1))
        seen = capture_grads(trainer)
        tokens: list[int] = []
        forward = trainer.model.forward
        trainer.model.forward = lambda *a, **k: (tokens.append(k["input_ids"].numel()), forward(*a, **k))[1]  # noqa: B023 (called in this iteration)
        m1 = trainer.train_step(step1 if mode != "live only" else step1[1::2])
        after1 = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        m2 = trainer.train_step(step2) if mode != "live only" else None
        after2 = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        runs[mode] = dict(m1=m1, m2=m2, seen=seen, after1=after1, after2=after2, tokens=tokens)
        monkeypatch.undo()
    skip, full = runs["skip"], runs["full"]
    assert skip["m1"]["skipped_samples"] == 4 and skip["m2"]["skipped_samples"] == 4
    assert full["m1"]["skipped_samples"] == 0
    assert sum(skip["tokens"]) == sum(len(s.tokens) for s in step1[1::2]) + 1  # step 2: one empty 1-token pass
    assert sum(full["tokens"]) == sum(len(s.tokens) for s in step1 + step2)
    for name in full["seen"][0]:
        torch.testing.assert_close(skip["seen"][0][name], full["seen"][0][name], atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(skip["after2"][name], full["after2"][name], atol=1e-6, rtol=1e-4)
    assert any(not torch.equal(skip["after1"][n], skip["after2"][n]) for n in skip["after1"])  # step 2 moved them
    assert skip["m1"]["loss"] == pytest.approx(full["m1"]["loss"], abs=1e-6)
    assert skip["m1"]["grad_norm"] == pytest.approx(full["m1"]["grad_norm"], rel=1e-5)
    # per-token statistics are means over the samples trained on, as if only they had been sent
    for key in ("entropy", "ratio_mean", "clipfrac"):
        assert skip["m1"][key] == pytest.approx(runs["live only"]["m1"][key], rel=1e-5, abs=1e-7), key
