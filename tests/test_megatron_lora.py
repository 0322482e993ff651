"""LoRA on the megatron backend (issue 40): the torch backend's PEFT adapter, trained on megatron's TP/PP layout.

On the tiny 2-layer Llama in fp32 on CPU. The torch backend (PEFT) is the reference throughout: both trainers start
from one adapter whose ``B`` is not zero (a fresh adapter's delta is zero, which would hide a wrong layout), and must
agree within 1e-5 on log-probs, the reference log-probs (the base, adapter off) and every adapter gradient. One
process checks TP=1; two gloo processes check TP=2 (A or B split, per the linear's kind) and PP=2. Then: only the
adapter trains, the engines get the merged weights, checkpoints are PEFT's and resume, bad flags are refused.
"""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest
import torch

from agentrl.trainer.megatron_compat import megatron_available

pytestmark = pytest.mark.e2e  # megatron's global state and spawned gloo processes: see conftest

if megatron_available():
    pytest.skip(megatron_available(), allow_module_level=True)

from peft import PeftModel  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from agentrl.config import RunConfig, TrainConfig  # noqa: E402
from agentrl.trainer.lora import ADAPTER_DIR  # noqa: E402
from agentrl.trainer.megatron_trainer import MegatronParallel, MegatronTrainer  # noqa: E402
from agentrl.trainer.torch_trainer import TorchTrainer  # noqa: E402

from .test_megatron_trainer import flat, megatron_state, off_policy  # noqa: E402,F401
from .test_trainer import cfg, make_samples, reference_log_probs  # noqa: E402

TOL = 1e-5


def lora_cfg(**kw) -> TrainConfig:
    return cfg(
        **{
            "lora_rank": 4,
            "lora_alpha": 8.0,
            "lr": 5e-3,
            "max_tokens_per_gpu": 40,
            "use_kl_loss": True,
            "kl_loss_coef": 0.1,
            "entropy_coef": 0.01,
            "clip_grad": 1.0,
            **kw,
        }
    )


def start_adapter(ckpt, folder, config: TrainConfig) -> TorchTrainer:
    """A torch LoRA trainer whose B is random (seeded), saved as a PEFT adapter in ``folder/adapter``."""
    trainer = TorchTrainer(ckpt, config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    trainer.save(folder)
    return trainer


def recorded_grads(trainer, read) -> dict:
    """Wrap ``trainer.optimizer.step`` to record ``read()`` (the adapter's gradients) before each step."""
    seen: list[dict] = []
    step = trainer.optimizer.step

    def recording(*a, **k):
        seen.append(read())
        return step(*a, **k)

    trainer.optimizer.step = recording
    return seen


def torch_grads(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {
        "base_model.model." + n.replace(".default.", "."): p.grad.detach().clone()
        for n, p in trainer.model.named_parameters()
        if ".lora_" in n
    }


def assert_close_dicts(got: dict, want: dict, atol: float = TOL, what: str = "") -> None:
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want))[:4])
    for k in want:
        torch.testing.assert_close(got[k].float(), want[k].float(), rtol=0, atol=atol, msg=f"{what} {k}")


def reference_run(tt: TorchTrainer, samples, read_grads=torch_grads, read_adapter=None) -> dict:
    """The torch backend's numbers: log-probs, reference log-probs, one train_step's metrics and adapter gradients
    (``read_grads(tt)``), then its weights and adapter (``read_adapter(tt)``; default: the run's one adapter)."""
    lp = tt.compute_log_probs(samples, ref=True)
    grads = recorded_grads(tt, lambda: read_grads(tt))
    metrics = tt.train_step(off_policy(samples, lp.old))
    return {
        "old": lp.old,
        "ref": lp.ref,
        "metrics": metrics,
        "grads": grads,
        "weights": dict(tt.named_weights()),
        "adapter": read_adapter(tt) if read_adapter else tt.adapter_weights()[0],
    }


def test_megatron_lora_matches_the_torch_adapter_and_saves_and_resumes_it(tiny_ckpt, tmp_path):
    # q and v without k, up without gate: the fused linears' missing parts give zeros in megatron's layout
    targets = ["q_proj", "self_attn.v_proj", "o_proj", "up_proj", "down_proj"]
    config = lora_cfg(lora_target_modules=targets, num_steps_per_rollout=2)
    samples = make_samples(10, seed=4)
    tt = start_adapter(tiny_ckpt, tmp_path / "start", config)
    want = reference_run(tt, samples)
    mt = MegatronTrainer(tiny_ckpt, dataclasses.replace(config, lora_adapter_path=str(tmp_path / "start/adapter")))
    assert mt.ref_model is None  # the reference is the base, adapter off: no second model
    assert {n for n, p in mt.model.named_parameters() if p.requires_grad} == set()
    trained = {id(p) for p in mt.lora.trainable()}
    assert {id(p) for g in mt.optimizer.param_groups for p in g["params"]} == trained
    lp = mt.compute_log_probs(samples, ref=True)
    torch.testing.assert_close(flat(lp.old), flat(want["old"]), rtol=0, atol=TOL)
    torch.testing.assert_close(flat(lp.ref), flat(want["ref"]), rtol=0, atol=TOL)
    assert (flat(lp.old) - flat(lp.ref)).abs().max() > 1e-3  # the adapter really changes the policy
    base = [p.detach().clone() for p in mt.model.parameters()]
    grads = recorded_grads(mt, lambda: mt._adapter_state(lambda p: p.grad))
    metrics = mt.train_step(off_policy(samples, lp.old))
    assert len(grads) == len(want["grads"]) == 2
    for got, wanted in zip(grads, want["grads"]):
        assert_close_dicts(got, wanted, what="grad")
    for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
        assert metrics[k] == pytest.approx(want["metrics"][k], rel=1e-4, abs=1e-6), k
    assert all(torch.equal(a, b) for a, b in zip(base, mt.model.parameters()))  # the base never moves
    merged = {k: v.clone() for k, v in mt.named_weights()}
    assert_close_dicts(
        merged, want["weights"], atol=2e-5, what="merged"
    )  # AdamW's eps regime: see test_megatron_trainer
    assert_close_dicts(mt.adapter_weights()[0], want["adapter"], atol=2e-5, what="adapter")

    # checkpoint: the merged HF folder and a PEFT adapter that PEFT loads to the megatron log-probs
    mt.save(tmp_path / "ckpt", {"k": 1})
    adapter = tmp_path / "ckpt" / ADAPTER_DIR
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["lora_alpha"] == 8.0 and saved["base_model_name_or_path"] == str(tiny_ckpt)
    assert set(saved["target_modules"]) == set(targets)
    after = mt.compute_log_probs(samples, ref=False).old
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_ckpt)), str(adapter)).eval()
    hf_merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt")).eval()
    for s, mine in zip(samples, after):
        torch.testing.assert_close(torch.tensor(mine), reference_log_probs(peft_model, s), atol=TOL, rtol=0)
        torch.testing.assert_close(torch.tensor(mine), reference_log_probs(hf_merged, s), atol=TOL, rtol=0)
    # resume: the adapter, its AdamW state and the step come back; the next step is the uninterrupted one
    resumed = MegatronTrainer(tiny_ckpt, config)
    assert resumed.load(tmp_path / "ckpt") == {"k": 1} and resumed.step == 2
    assert flat(resumed.compute_log_probs(samples, ref=False).old).sub(flat(after)).abs().max() == 0
    more = off_policy(make_samples(8, seed=6), [[-3.0] * s.response_length for s in make_samples(8, seed=6)])
    mt.train_step(more)
    resumed.train_step(more)
    assert all(torch.equal(a, b) for a, b in zip(mt.lora.trainable(), resumed.lora.trainable()))
    # a checkpoint of the other kind, or an adapter of other modules, is refused before anything is replaced
    with pytest.raises(ValueError, match="saved by a LoRA run"):
        MegatronTrainer(tiny_ckpt, cfg()).load(tmp_path / "ckpt")
    other = MegatronTrainer(tiny_ckpt, lora_cfg())
    before = [p.detach().clone() for p in other.lora.trainable()]
    with pytest.raises(ValueError, match="adapts other modules"):
        other.load(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(before, other.lora.trainable())) and other.step == 0


def test_a_fresh_megatron_adapter_starts_as_the_base_and_only_it_trains(tiny_ckpt):
    config = lora_cfg(lora_init="gaussian")
    full = MegatronTrainer(tiny_ckpt, cfg(max_tokens_per_gpu=40))
    samples = make_samples(6, seed=2)
    base_lp = full.compute_log_probs(samples, ref=False).old
    mt = MegatronTrainer(tiny_ckpt, config)
    lp = mt.compute_log_probs(samples, ref=True)
    assert flat(lp.old).sub(flat(base_lp)).abs().max() == 0 and flat(lp.ref).sub(flat(base_lp)).abs().max() == 0
    sizes = {k: tuple(v.shape) for k, v in mt.adapter_weights()[0].items()}
    assert sizes["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] == (4, 64)
    assert len(sizes) == 2 * 7 * 2  # 7 linears of 2 layers, A and B each: PEFT's all-linear without the head
    assert mt.adapted_modules() == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    mt.train_step(off_policy(samples, lp.old))
    moved = mt.compute_log_probs(samples, ref=True)
    assert flat(moved.old).sub(flat(base_lp)).abs().max() > 1e-4
    assert flat(moved.ref).sub(flat(base_lp)).abs().max() == 0  # the reference stays the base


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(lora_target_modules=["lm_head"]), "--lora-target-modules lm_head: the megatron backend adapts"),
        (dict(lora_dropout=0.1, loss_type="sft_loss"), "--lora-dropout 0.1: the megatron backend has no LoRA dropout"),
        (dict(initial_megatron_checkpoint="/x"), "--initial-megatron-checkpoint"),
        (
            dict(lora_target_modules=["model.layers.0.self_attn.q_proj"], pipeline_model_parallel_size=2),
            "leaves the other pipeline stages nothing to train",
        ),
    ],
)
def test_what_megatron_lora_cannot_do_is_refused_before_anything_starts(tiny_ckpt, kw, message):
    def run(**train) -> RunConfig:
        return RunConfig(env="agentrl.envs.digits:Digits", train=TrainConfig(**train), train_backend="megatron")

    with pytest.raises(ValueError, match=message):
        run(lora_rank=4, **kw).validate()
    run(lora_rank=4, lora_target_modules=["q_proj", "self_attn.v_proj"]).validate()
    with pytest.raises(ValueError, match=message):  # and by the trainer itself, for a direct caller
        MegatronTrainer(tiny_ckpt, cfg(lora_rank=4, **kw))


# ---------------------------------------------------------------- two processes: TP=2, PP=2

LAYOUTS = {
    "tp2": MegatronParallel(tensor_model_parallel_size=2),
    "pp2": MegatronParallel(pipeline_model_parallel_size=2),
}


def _worker(rank: int, port: int, ckpt: str, adapter: str, out: str) -> None:
    import torch.distributed as dist

    from agentrl.trainer.megatron_compat import destroy_megatron_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    samples = make_samples(10, seed=4)
    config = dataclasses.replace(two_process_config(), lora_adapter_path=adapter)
    for name, layout in LAYOUTS.items():
        mt = MegatronTrainer(ckpt, config, rank=rank, world_size=2, parallel=layout)
        lp = mt.compute_log_probs(samples, ref=True)
        grads = recorded_grads(mt, lambda mt=mt: mt._adapter_state(lambda p: p.grad))
        metrics = mt.train_step(off_policy(samples, lp.old))
        weights = {k: v.clone() for k, v in mt.named_weights()}
        mt.save(f"{out}.{name}.ckpt")
        results[name] = {"old": lp.old, "ref": lp.ref, "metrics": metrics}
        if rank == 0:
            torch.save({"grads": grads, "weights": weights}, f"{out}.{name}.pt")
        destroy_megatron_parallel()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def two_process_config() -> TrainConfig:
    return lora_cfg(num_steps_per_rollout=2)


def test_two_processes_tp2_and_pp2_match_the_torch_adapter(tiny_ckpt, tmp_path, monkeypatch):
    """TP=2 (column: B split by rows, row: A split by columns) and PP=2 give torch's numbers within 1e-5."""
    import torch.multiprocessing as mp

    config, samples = two_process_config(), make_samples(10, seed=4)
    want = reference_run(start_adapter(tiny_ckpt, tmp_path / "start", config), samples)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "results.json")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two ranks on two cores
    mp.spawn(_worker, args=(port, str(tiny_ckpt), str(tmp_path / "start/adapter"), out), nprocs=2, join=True)
    results = json.loads(open(out).read())
    for name in LAYOUTS:
        r = results[name]
        torch.testing.assert_close(flat(r["old"]), flat(want["old"]), rtol=0, atol=TOL, msg=name)
        torch.testing.assert_close(flat(r["ref"]), flat(want["ref"]), rtol=0, atol=TOL, msg=name)
        for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
            assert r["metrics"][k] == pytest.approx(want["metrics"][k], rel=1e-4, abs=1e-6), (name, k)
        saved = torch.load(f"{out}.{name}.pt")
        assert len(saved["grads"]) == 2
        for got, wanted in zip(saved["grads"], want["grads"]):
            assert_close_dicts(got, wanted, what=f"{name} grad")
        assert_close_dicts(saved["weights"], want["weights"], atol=2e-5, what=f"{name} merged")
        # rank 0 wrote the whole adapter (both TP halves, both stages): the torch trainer's after its step
        folder = tmp_path / f"results.json.{name}.ckpt" / ADAPTER_DIR
        assert_close_dicts(load_file(str(folder / "adapter_model.safetensors")), want["adapter"], 2e-5, name)


# ---------------------------------------------------------------- end to end


def test_agentrl_train_megatron_tp2_lora_pushes_the_adapter_and_resumes(tiny_ckpt, tmp_path, ray_local):
    """`agentrl train --train-backend megatron --tensor-model-parallel-size 2 --lora-rank 4 --weight-sync adapter`:
    two trainer ranks hold the adapter split over TP; each step the engine gets the whole adapter (gathered from
    both ranks) and serves it on its unchanged base (--true-on-policy-mode: the trainer's log-probs of the sampled
    tokens equal the engine's); the checkpoints carry the adapter and --load resumes it."""
    from agentrl.runtime.train import train
    from tests.test_train import _cfg, _lines

    save = tmp_path / "run"
    train_kw = {"lora_rank": 4, "lr": 2e-2, "use_kl_loss": True, "kl_loss_coef": 0.1, "tensor_model_parallel_size": 2}
    kw = dict(
        train_backend="megatron",
        trainer_num_procs=2,
        weight_sync="adapter",
        save_interval=1,
        true_on_policy_mode=True,
        train=train_kw,
    )
    summary = train(_cfg(tiny_ckpt, save, num_rollout=2, **kw))
    assert summary["weight_sync"] == ["adapter"] and summary["weight_version"] == 2
    lines = _lines(save)
    assert all(line["true_on_policy_logprob_diff_max"] < 1e-3 for line in lines)  # the engine serves the adapter
    assert lines[-1]["kl"] != 0.0  # the adapter moved the policy away from the base
    adapter = save / "iter_0000002" / ADAPTER_DIR
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (64, 4)  # whole
    assert tensors["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"].shape == (4, 64)
    summary = train(_cfg(tiny_ckpt, save, num_rollout=3, load=str(save), **kw))
    assert summary["weight_version"] == 3
    lines = _lines(save)
    assert [line["step"] for line in lines] == [0, 1, 2] and lines[-1]["true_on_policy_logprob_diff_max"] < 1e-3
