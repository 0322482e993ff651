"""The megatron backend computes what the torch backend computes: log-probs, one policy step, checkpoints.

All on the tiny 2-layer Llama (vocab 400, padded to 512 by Megatron) in fp32 on CPU. The TorchTrainer
is the reference: same samples, same config, and the two must agree to float rounding. The last test
spawns two gloo processes and checks that TP=2, PP=2 (also with tied embeddings, plus a sharded
save/resume) and DP=2 reproduce the single-process numbers.

Megatron keeps its parallel state in module globals, so every trainer of this module (all world size 1,
tp=pp=1) shares one state; the module fixture tears it and the loopback process group down at the end.
"""

from __future__ import annotations

import dataclasses
import json
import random
import socket

import pytest
import torch

from agentrl.trainer.megatron_compat import megatron_available

pytestmark = pytest.mark.e2e  # engine processes, Ray, several processes or a browser: see conftest

if megatron_available():
    pytest.skip(megatron_available(), allow_module_level=True)

from agentrl.trainer.base import TrainSample  # noqa: E402
from agentrl.trainer.batching import pack_micro_batches  # noqa: E402
from agentrl.trainer.megatron_critic import MegatronCritic  # noqa: E402
from agentrl.trainer.megatron_trainer import MegatronParallel, MegatronTrainer  # noqa: E402
from agentrl.trainer.torch_critic import TorchCritic  # noqa: E402
from agentrl.trainer.torch_trainer import TorchTrainer  # noqa: E402

from .test_trainer import cfg, make_samples, reference_log_probs  # noqa: E402

METRICS = ("loss", "pg_loss", "kl", "entropy", "clipfrac", "ratio_mean", "grad_norm", "train_tokens", "steps")


@pytest.fixture(scope="module", autouse=True)
def megatron_state():
    """Tear down megatron's global parallel state and the private process group after this module."""
    yield
    import torch.distributed as dist

    from agentrl.trainer.megatron_compat import destroy_megatron_parallel

    destroy_megatron_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def flat(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor([x for v in values for x in v])


def off_policy(samples: list[TrainSample], logp: list[list[float]], seed: int = 0) -> list[TrainSample]:
    """Old log-probs = current ones + noise, so ratios differ from 1 and some tokens clip."""
    rng = random.Random(seed)
    return [
        dataclasses.replace(s, old_log_probs=[x + rng.uniform(-0.4, 0.4) for x in lp]) for s, lp in zip(samples, logp)
    ]


def assert_metrics_close(got: dict[str, float], want: dict[str, float]) -> None:
    for k in METRICS:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k


def assert_weights_close(megatron: MegatronTrainer, torch_trainer: TorchTrainer, atol: float = 2e-5) -> None:
    """Same HF names and values; atol = 2% of lr 1e-3 (AdamW's eps regime amplifies rounding of tiny grads)."""
    mine = {k: v.clone() for k, v in megatron.named_weights()}
    ref = dict(torch_trainer.named_weights())
    assert set(mine) == set(ref)
    for k in ref:
        torch.testing.assert_close(mine[k], ref[k], rtol=1e-4, atol=atol, msg=k)


# ---------------------------------------------------------------- log-probs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_match_torch_trainer(tiny_ckpt, temperature):
    samples = make_samples(10, seed=1)
    c = cfg(max_tokens_per_gpu=40, logit_temperature=temperature)
    assert len(pack_micro_batches([len(s.tokens) for s in samples], 40)) >= 3  # really several micro-batches
    got = MegatronTrainer(tiny_ckpt, c).compute_log_probs(samples, ref=False)
    want = TorchTrainer(tiny_ckpt, c).compute_log_probs(samples, ref=False)
    assert [len(v) for v in got.old] == [s.response_length for s in samples]
    torch.testing.assert_close(flat(got.old), flat(want.old), rtol=0, atol=1e-4)


def test_packing_does_not_change_log_probs(tiny_ckpt):
    samples = make_samples(8, seed=2)
    trainer = MegatronTrainer(tiny_ckpt, cfg(max_tokens_per_gpu=4096))
    packed = trainer.compute_log_probs(samples, ref=False).old  # one row holds every sample
    trainer.parallel = dataclasses.replace(trainer.parallel, micro_batch_size=1)  # one sample per row
    alone = trainer.compute_log_probs(samples, ref=False).old
    torch.testing.assert_close(flat(packed), flat(alone), rtol=0, atol=1e-5)
    # and the reference, one plain HF forward per sample
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt)
    for s, lp in zip(samples, packed):
        torch.testing.assert_close(torch.tensor(lp), reference_log_probs(hf, s), rtol=0, atol=1e-4)


# ---------------------------------------------------------------- training


@pytest.mark.parametrize(
    "extra",
    [
        dict(clip_grad=1.0),
        dict(
            use_kl_loss=True,
            kl_loss_coef=0.1,
            kl_loss_type="k3",
            entropy_coef=0.01,
            num_steps_per_rollout=2,
            calculate_per_token_loss=True,
        ),
    ],
    ids=["clip", "kl_entropy_2steps"],
)
def test_train_step_matches_torch_trainer(tiny_ckpt, extra):
    c = cfg(max_tokens_per_gpu=40, **extra)
    samples = make_samples(10, seed=4)
    tt, mt = TorchTrainer(tiny_ckpt, c), MegatronTrainer(tiny_ckpt, c)
    samples = off_policy(samples, tt.compute_log_probs(samples, ref=False).old)
    want, got = tt.train_step(samples), mt.train_step(samples)
    assert want["clipfrac"] > 0 and want["grad_norm"] > 0
    if c.use_kl_loss:
        assert want["kl"] > 0 and want["entropy"] > 0  # the second step moved away from the reference
    assert_metrics_close(got, want)
    assert_weights_close(mt, tt)


# ---------------------------------------------------------------- checkpoints


def test_save_load_resumes_exactly_and_is_a_hf_checkpoint(tiny_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    c = cfg(max_tokens_per_gpu=48, clip_grad=1.0)
    first, second = make_samples(8, seed=5), make_samples(8, seed=6)
    a = MegatronTrainer(tiny_ckpt, c)
    a.train_step(first)
    a.save(tmp_path / "ckpt", extra_state={"rollout": 3})
    for name in ("config.json", "model.safetensors", "tokenizer.json", "trainer_state.pt", "optim_rank0.pt"):
        assert (tmp_path / "ckpt" / name).is_file(), name

    b = MegatronTrainer(tiny_ckpt, c)
    assert b.load(tmp_path / "ckpt") == {"rollout": 3} and b.step == 1
    logp = b.compute_log_probs(second, ref=False).old
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")  # the trained weights, as transformers reads them
    for s, lp in zip(second, logp):
        torch.testing.assert_close(torch.tensor(lp), reference_log_probs(hf, s), rtol=0, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(tiny_ckpt)
    assert (reference_log_probs(base, second[0]) - torch.tensor(logp[0])).abs().max() > 1e-3  # it did train

    ma, mb = a.train_step(second), b.train_step(second)
    for k in METRICS:
        assert ma[k] == mb[k], k  # bit-exact resume
    for (na, ta), (nb, tb) in zip(a.named_weights(), b.named_weights()):
        assert na == nb and torch.equal(ta, tb), na


def test_critic_matches_the_torch_critic_and_resumes_exactly(tiny_ckpt, tmp_path):
    """Values, the value step and the values after it agree with TorchCritic; a saved critic resumes bit-exactly."""
    c = cfg(advantage_estimator="ppo", critic_lr=1e-2, max_tokens_per_gpu=40, num_steps_per_rollout=2)
    samples = make_samples(8, seed=8)
    tc, mc = TorchCritic(tiny_ckpt, c), MegatronCritic(tiny_ckpt, c)
    want_v, got_v = tc.compute_values(samples), mc.compute_values(samples)
    torch.testing.assert_close(flat(got_v), flat(want_v), rtol=0, atol=1e-4)
    batch = with_targets(samples, want_v)
    want, got = tc.train_step(batch), mc.train_step(batch)
    for k in ("value_loss", "value_clipfrac", "values_mean", "grad_norm"):
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    torch.testing.assert_close(flat(mc.compute_values(samples)), flat(tc.compute_values(samples)), rtol=0, atol=2e-4)
    with pytest.raises(TypeError, match="compute_values"):
        mc.compute_log_probs(samples, ref=False)
    mc.save(tmp_path / "critic", extra_state={"k": 1})
    again = MegatronCritic(tiny_ckpt, c)
    assert again.load(tmp_path / "critic") == {"k": 1}
    assert again.compute_values(samples) == mc.compute_values(samples)
    batch = with_targets(samples, mc.compute_values(samples))
    ma, mb = mc.train_step(batch), again.train_step(batch)
    for k in ("value_loss", "value_clipfrac", "values_mean", "grad_norm"):
        assert ma[k] == mb[k], k  # bit-exact resume
    assert again.compute_values(samples) == mc.compute_values(samples)


def test_load_refuses_another_layout(tiny_ckpt, tmp_path):
    c = cfg()
    TorchTrainer(tiny_ckpt, c).save(tmp_path / "torch")
    with pytest.raises(ValueError, match="same world size and tp/pp/cp"):
        MegatronTrainer(tiny_ckpt, c).load(tmp_path / "torch")


def test_unsupported_layouts_say_what_to_do(tiny_ckpt):
    with pytest.raises(ValueError, match="not a multiple of tp\\*pp\\*cp"):
        MegatronTrainer(tiny_ckpt, cfg(), parallel=MegatronParallel(tensor_model_parallel_size=2))
    with pytest.raises(NotImplementedError, match="--context-parallel-size 1"):
        MegatronTrainer(tiny_ckpt, cfg(), world_size=2, parallel=MegatronParallel(context_parallel_size=2))


# ---------------------------------------------------------------- two processes: TP=2, PP=2, DP=2

LAYOUTS = {
    "tp2": MegatronParallel(tensor_model_parallel_size=2),
    "pp2": MegatronParallel(pipeline_model_parallel_size=2),
    "dp2": MegatronParallel(),
    "pp2_tied": MegatronParallel(pipeline_model_parallel_size=2),
}


def tied_copy(ckpt, dest):
    """The tiny model with tied embeddings (as SmolLM2): with PP the head is a copy on the last stage."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ckpt, tie_word_embeddings=True)
    model.tie_weights()
    with torch.no_grad():  # tied, the constant embedding column 0 shifts every logit alike: its norm-weight
        # gradient would be exactly 0 (float noise, which AdamW's first step turns into +-lr)
        model.model.embed_tokens.weight[:, 0] += 0.1 * torch.randn(
            model.config.vocab_size, generator=torch.Generator().manual_seed(0)
        )
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(ckpt).save_pretrained(dest)
    return dest


def _shard(samples: list, name: str, rank: int) -> list:
    """DP: each replica its half of each of the 2 steps' global batches (as the runtime shards); TP/PP: all."""
    return [s for k in (0, 4) for s in samples[k + 2 * rank : k + 2 * rank + 2]] if name == "dp2" else samples


def _run_layout(name: str, layout: MegatronParallel, ckpt: str, rank: int, out: str) -> dict:
    """One layout on this rank: log-probs (gathered from both ranks), one train_step, its weights."""
    import torch.distributed as dist

    samples = two_process_samples()
    trainer = MegatronTrainer(ckpt, two_process_config(), rank=rank, world_size=2, parallel=layout)
    mine = _shard(samples, name, rank)
    gathered: list = [None, None]
    dist.all_gather_object(gathered, trainer.compute_log_probs(mine, ref=False).old)
    result = {
        "metrics": trainer.train_step(mine),
        "same_on_peer": name == "dp2" or gathered[0] == gathered[1],
        "logp": [lp for k in (0, 2) for r in (0, 1) for lp in gathered[r][k : k + 2]]
        if name == "dp2"
        else gathered[rank],
    }
    weights = {k: v.clone() for k, v in trainer.named_weights()}
    if rank == 0:
        torch.save(weights, f"{out}.{name}.pt")
    result["critic"] = _critic_layout(name, layout, ckpt, rank, mine)
    if name == "tp2":  # peers of one replica given different samples: refused on both ranks
        with pytest.raises(ValueError, match="same shard"):
            trainer.compute_log_probs(samples[rank : rank + 2], ref=False)
    if name == "pp2_tied":  # sharded save -> load in a fresh trainer -> the next step is identical
        trainer.save(f"{out}.ckpt", extra_state={"k": 1})
        resumed = MegatronTrainer(ckpt, two_process_config(), rank=rank, world_size=2, parallel=layout)
        assert resumed.load(f"{out}.ckpt") == {"k": 1}
        result["resumed_equal"] = trainer.train_step(mine)["loss"] == resumed.train_step(mine)["loss"] and all(
            torch.equal(a, b) for (_, a), (_, b) in zip(trainer.named_weights(), resumed.named_weights())
        )
    return result


def _critic_layout(name: str, layout: MegatronParallel, ckpt: str, rank: int, mine: list) -> dict:
    """The critic on this layout: values before and after two optimizer steps toward a fixed return."""
    import torch.distributed as dist

    from agentrl.trainer.megatron_critic import MegatronCritic

    def gathered(values: list[list[float]]) -> list[list[float]]:
        both: list = [None, None]
        dist.all_gather_object(both, values)
        if name == "dp2":  # back into the order of the whole batch (see _shard)
            return [v for k in (0, 2) for r in (0, 1) for v in both[r][k : k + 2]]
        assert both[0] == both[1], name  # TP/PP peers of one replica agree
        return both[rank]

    critic = MegatronCritic(ckpt, two_process_critic_config(), rank=rank, world_size=2, parallel=layout)
    values = critic.compute_values(mine)
    metrics = critic.train_step(with_targets(mine, values))
    return {"values": gathered(values), "metrics": metrics, "after": gathered(critic.compute_values(mine))}


def two_process_critic_config():
    return dataclasses.replace(two_process_config(), advantage_estimator="ppo", critic_lr=1e-2)


def with_targets(samples: list, values: list[list[float]]) -> list:
    return [
        dataclasses.replace(s, values=v, returns=[1.0 if m else 0.0 for m in s.loss_mask])
        for s, v in zip(samples, values)
    ]


def _worker(rank: int, port: int, ckpts: dict[str, str], out: str) -> None:
    """One of two gloo ranks: every layout in turn; rank 0 writes the results."""
    import torch.distributed as dist

    from agentrl.trainer.megatron_compat import destroy_megatron_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for name, layout in LAYOUTS.items():
        results[name] = _run_layout(name, layout, ckpts["tied" if name.endswith("tied") else "untied"], rank, out)
        destroy_megatron_parallel()  # the next layout re-initialises megatron's groups
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def two_process_samples() -> list[TrainSample]:
    return off_policy(make_samples(8, seed=7), [[-5.0] * s.response_length for s in make_samples(8, seed=7)])


def two_process_config():
    """Every loss term on (entropy with grad, KL against the reference), two optimizer steps."""
    return cfg(
        max_tokens_per_gpu=40,
        clip_grad=1.0,
        entropy_coef=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        num_steps_per_rollout=2,
    )


def test_two_processes_tp_pp_dp_match_one(tiny_ckpt, tmp_path, monkeypatch):
    """TP=2, PP=2 (untied and tied embeddings) and DP=2 over gloo give the single-process numbers."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    c, samples = two_process_config(), two_process_samples()
    ckpts = {"untied": str(tiny_ckpt), "tied": str(tied_copy(tiny_ckpt, tmp_path / "tied"))}
    refs, wants, critics = {}, {}, {}
    for kind, ckpt in ckpts.items():
        refs[kind] = TorchTrainer(ckpt, c)
        wants[kind] = (flat(refs[kind].compute_log_probs(samples, ref=False).old), refs[kind].train_step(samples))
        critic = TorchCritic(ckpt, two_process_critic_config())
        values = critic.compute_values(samples)
        metrics = critic.train_step(with_targets(samples, values))
        critics[kind] = {"values": values, "metrics": metrics, "after": critic.compute_values(samples)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "results.json")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two ranks on two cores
    mp.spawn(_worker, args=(port, ckpts, out), nprocs=2, join=True)
    results = json.loads(open(out).read())
    for name in LAYOUTS:
        kind, r = "tied" if name.endswith("tied") else "untied", results[name]
        want_logp, want = wants[kind]
        assert r["same_on_peer"], name
        torch.testing.assert_close(flat(r["logp"]), want_logp, rtol=0, atol=1e-4, msg=name)
        assert_metrics_close(r["metrics"], want)
        got_c, want_c = r["critic"], critics[kind]  # the critic: replicated head over TP, untied head over PP
        torch.testing.assert_close(flat(got_c["values"]), flat(want_c["values"]), rtol=0, atol=1e-4, msg=name)
        for k in ("value_loss", "grad_norm"):
            assert got_c["metrics"][k] == pytest.approx(want_c["metrics"][k], rel=1e-4, abs=1e-6), (name, k)
        torch.testing.assert_close(flat(got_c["after"]), flat(want_c["after"]), rtol=0, atol=2e-4, msg=name)
        weights = torch.load(f"{out}.{name}.pt")
        for k, v in refs[kind].named_weights():
            torch.testing.assert_close(weights[k], v, rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")
    assert results["pp2_tied"]["resumed_equal"]
    hf = AutoModelForCausalLM.from_pretrained(f"{out}.ckpt")  # written by rank 0 from both stages
    weights = torch.load(f"{out}.pp2_tied.pt")
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(v, weights[k if k != "lm_head.weight" else "model.embed_tokens.weight"], msg=k)


def test_custom_loss_matches_the_torch_trainer(tiny_ckpt, tmp_path):
    """--loss-type custom_loss on megatron: the same function, the same numbers as on the torch backend."""
    from .test_custom_loss import LOSSES

    (tmp_path / "my_losses.py").write_text(LOSSES)
    samples = [
        dataclasses.replace(s, train_metadata={"w": float(i % 3)}) for i, s in enumerate(make_samples(8, seed=6))
    ]
    c = cfg(
        max_tokens_per_gpu=48, loss_type="custom_loss", custom_loss_function_path=f"{tmp_path}/my_losses.py:weighted"
    )
    tt, mt = TorchTrainer(tiny_ckpt, c), MegatronTrainer(tiny_ckpt, c)
    want, got = tt.train_step(samples), mt.train_step(samples)
    assert got["w_seen"] == want["w_seen"] == sum(i % 3 for i in range(8))
    assert got["weighted_nll"] == pytest.approx(want["weighted_nll"], rel=1e-4)
    assert_weights_close(mt, tt)


# ---------------------------------------------------------------- --initial-megatron-checkpoint


def _save_dist_checkpoint(model, folder) -> None:
    """Write ``model`` with megatron-core's own dist_checkpointing.save (Megatron-LM's layout: ``{"model": ...}``
    under ``iter_0000003`` plus the tracker). Its writer calls torch.cuda.synchronize(), a GPU barrier that cannot
    run on this CPU-only torch: no-op'd while the fixture is written (the GPU test writes one unpatched)."""
    from unittest import mock

    from megatron.core import dist_checkpointing

    it = folder / "iter_0000003"
    it.mkdir(parents=True)
    with mock.patch("torch.cuda.synchronize", lambda *a, **k: None):
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(it))
    (folder / "latest_checkpointed_iteration.txt").write_text("3")


def test_initial_megatron_checkpoint_starts_policy_and_reference_from_it(tiny_ckpt, tmp_path):
    from agentrl.trainer.megatron_model import resolve_megatron_checkpoint

    samples = make_samples(6, seed=11)
    trained = MegatronTrainer(tiny_ckpt, cfg(lr=1e-2))
    trained.train_step(samples)
    _save_dist_checkpoint(trained.model, tmp_path / "mlm")
    assert resolve_megatron_checkpoint(tmp_path / "mlm") == tmp_path / "mlm" / "iter_0000003"

    c = cfg(initial_megatron_checkpoint=str(tmp_path / "mlm"), use_kl_loss=True, kl_loss_coef=0.1)
    started = MegatronTrainer(tiny_ckpt, c)
    lp = started.compute_log_probs(samples, ref=True)
    want = trained.compute_log_probs(samples, ref=False).old
    torch.testing.assert_close(flat(lp.old), flat(want), rtol=0, atol=1e-6)
    torch.testing.assert_close(flat(lp.ref), flat(want), rtol=0, atol=1e-6)  # the reference is the start, too
    fresh = MegatronTrainer(tiny_ckpt, cfg()).compute_log_probs(samples, ref=False).old
    assert (flat(fresh) - flat(want)).abs().max() > 1e-3  # it did not just start from the HF weights
    # the weights the engines get are the loaded ones, in HF names
    for (name, a), (_, b) in zip(started.named_weights(), trained.named_weights()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)

    with pytest.raises(ValueError, match="not a megatron-core distributed checkpoint"):
        resolve_megatron_checkpoint(tmp_path)
    other = tmp_path / "other.json"
    other.mkdir()
    (other / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    with pytest.raises(ValueError, match="a 'zarr' checkpoint"):
        resolve_megatron_checkpoint(other)


def test_initial_megatron_checkpoint_of_another_architecture_is_refused(tiny_ckpt, tied_ckpt, tmp_path):
    _save_dist_checkpoint(MegatronTrainer(tied_ckpt, cfg()).model, tmp_path / "tied")  # vocab 400 vs 300
    with pytest.raises(ValueError, match="could not be loaded into the model built from --hf-checkpoint's config"):
        MegatronTrainer(tiny_ckpt, cfg(initial_megatron_checkpoint=str(tmp_path / "tied")))
