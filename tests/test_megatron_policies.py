"""Several policies on the megatron backend (issue 40): an adapter per ``--policy`` on megatron's TP/PP layout, trained
from one mixed stream, against the torch backend's several policies (PEFT) within 1e-5.

On the tiny 2-layer Llama in fp32 on CPU. Both backends start from the same two adapters (B not zero, so a token on
the wrong adapter shows); rows pack samples of both policies. They must agree on every row's log-probs, the reference
(every adapter off), each policy's gradient, loss terms, norms and learning rates; the checkpoint holds each policy's
PEFT adapter, which PEFT loads to the megatron log-probs, and resumes exactly. One process checks TP=1; two gloo
processes check TP=2 (the router's slices pass megatron's TP collectives), PP=2 (each stage routes its micro-batch)
and DP=2 (a replica without one policy's rows adds a zero gradient to the other's). Then `agentrl train` end to end.
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
from agentrl.trainer.lora import POLICIES_DIR  # noqa: E402
from agentrl.trainer.megatron_trainer import MegatronParallel, MegatronTrainer  # noqa: E402
from agentrl.trainer.torch_trainer import TorchTrainer  # noqa: E402

from .test_megatron_lora import assert_close_dicts, lora_cfg, recorded_grads, start_adapter  # noqa: E402
from .test_megatron_lora import reference_run as lora_reference_run  # noqa: E402
from .test_megatron_trainer import flat, off_policy  # noqa: E402
from .test_trainer import make_samples, reference_log_probs  # noqa: E402

TOL = 1e-5
# adapters after two AdamW steps: gradients agree within TOL, but an element whose gradient is near AdamW's eps moves
# by a fraction of lr that such a difference changes (lr 5e-3 here; seen 6.7e-5). A token trained on the wrong adapter
# moves its elements by ~lr, far outside this.
STEPPED = 1e-4
POLICIES = ["solver", "judge"]
COMPARED = ["loss", "pg_loss", "kl", "entropy", "grad_norm", "grad_norm/solver", "grad_norm/judge"]
COMPARED += ["pg_loss/solver", "pg_loss/judge", "lr/solver", "lr/judge"]


CLIP = 0.33  # between the two policies' gradient norms: one is clipped, the other not (asserted below)


def policies_cfg(**kw) -> TrainConfig:
    return lora_cfg(
        **{"policy": POLICIES, "policy_lr": ["judge=2e-3"], "num_steps_per_rollout": 2, "clip_grad": CLIP, **kw}
    )


def mixed(n: int, seed: int):
    """Samples of both policies in an uneven order (rows hold several of each, not sorted)."""
    samples = make_samples(n, seed=seed)
    return [dataclasses.replace(s, policy=POLICIES[(i * i + i // 3) % 2]) for i, s in enumerate(samples)]


def torch_grads(trainer: TorchTrainer) -> dict[str, dict[str, torch.Tensor]]:
    """Each policy's adapter gradients in PEFT's file names (as megatron's ``_adapter_state`` names them)."""
    return {
        policy: {
            "base_model.model." + n.replace(f".{policy}.", "."): p.grad.detach().clone()
            for n, p in trainer.model.named_parameters()
            if f".lora_A.{policy}." in n or f".lora_B.{policy}." in n
        }
        for policy in POLICIES
    }


def megatron_grads(mt: MegatronTrainer) -> dict[str, dict[str, torch.Tensor]]:
    return {policy: mt._adapter_state(lambda p: p.grad, policy=policy) for policy in POLICIES}


def load_start(mt: MegatronTrainer, folder) -> None:
    assert mt.routes is not None
    for name in POLICIES:
        adapter = folder / POLICIES_DIR / name
        mt.routes.of(name).load_peft_state(load_file(str(adapter / "adapter_model.safetensors")), source=str(adapter))


def reference_run(tt: TorchTrainer, samples) -> dict:
    """test_megatron_lora's reference run, each policy's gradients and adapter apart."""
    return lora_reference_run(
        tt, samples, torch_grads, lambda tt: {name: tt.adapter_weights(name)[0] for name in POLICIES}
    )


def assert_matches(got_metrics: dict, got_grads: list, want: dict, what: str = "") -> None:
    for k in COMPARED:
        assert got_metrics[k] == pytest.approx(want["metrics"][k], rel=1e-4, abs=1e-6), (what, k)
    assert len(got_grads) == len(want["grads"]) == 2
    for got, wanted in zip(got_grads, want["grads"]):
        for name in POLICIES:
            assert_close_dicts(got[name], wanted[name], what=f"{what} {name} grad")


def test_megatron_policies_match_the_torch_policies_and_save_and_resume(tiny_ckpt, tmp_path):
    config, samples = policies_cfg(), mixed(10, seed=4)
    want = reference_run(start_adapter(tiny_ckpt, tmp_path / "start", config), samples)
    # each policy clipped alone: one above the clip, one below (a global clip would scale both: the grads differ)
    assert want["metrics"]["grad_norm/solver"] > CLIP > want["metrics"]["grad_norm/judge"], want["metrics"]
    mt = MegatronTrainer(tiny_ckpt, config)
    load_start(mt, tmp_path / "start")
    assert mt.ref_model is None and mt.lora is None  # the reference is the base, every adapter off
    assert {n for n, p in mt.model.named_parameters() if p.requires_grad} == set()
    groups = {g["policy"]: {id(p) for p in g["params"]} for g in mt.optimizer.param_groups}
    assert groups == {n: {id(p) for p in mt.routes.trainable(n)} for n in POLICIES}
    lp = mt.compute_log_probs(samples, ref=True)
    torch.testing.assert_close(flat(lp.old), flat(want["old"]), rtol=0, atol=TOL)
    torch.testing.assert_close(flat(lp.ref), flat(want["ref"]), rtol=0, atol=TOL)
    # the adapters differ: every row on one adapter would not give these log-probs
    one = MegatronTrainer(tiny_ckpt, config)
    load_start(one, tmp_path / "start")
    same = [dataclasses.replace(s, policy="solver") for s in samples]
    wrong = flat(one.compute_log_probs(same, ref=False).old) - flat(lp.old)
    assert wrong.abs().max() > 1e-3
    base = [p.detach().clone() for p in mt.model.parameters()]
    grads = recorded_grads(mt, lambda: megatron_grads(mt))
    metrics = mt.train_step(off_policy(samples, lp.old))
    assert_matches(metrics, grads, want)
    assert metrics["lr/judge"] == 2e-3 and metrics["lr/solver"] == 5e-3
    assert all(torch.equal(a, b) for a, b in zip(base, mt.model.parameters()))  # the base never moves
    for name in POLICIES:
        assert_close_dicts(mt.adapter_weights(name)[0], want["adapter"][name], atol=STEPPED, what=name)
    base_weights = load_file(str(tiny_ckpt / "model.safetensors"))  # the engines get the base (adapters by name)
    pushed = dict(mt.named_weights())
    assert set(pushed) == set(base_weights) and all(torch.equal(pushed[k], base_weights[k]) for k in pushed)
    for bad in (None, "nobody"):
        with pytest.raises(ValueError, match="this trainer trains the policies"):
            mt.adapter_weights(bad)

    # each policy's PEFT adapter, loadable by PEFT to the megatron log-probs of that policy's rows
    mt.save(tmp_path / "ckpt", {"k": 1})
    after = mt.compute_log_probs(samples, ref=False).old
    for name in POLICIES:
        folder = tmp_path / "ckpt" / POLICIES_DIR / name
        assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_ckpt)
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_ckpt)), str(folder))
        for s, mine in zip(samples, after):
            if s.policy == name:
                torch.testing.assert_close(
                    torch.tensor(mine), reference_log_probs(peft_model.eval(), s), atol=TOL, rtol=0
                )
    # resume: both adapters, their AdamW state and the step; the next step is the uninterrupted one
    resumed = MegatronTrainer(tiny_ckpt, config)
    assert resumed.load(tmp_path / "ckpt") == {"k": 1} and resumed.step == 2
    more = mixed(8, seed=6)
    more = off_policy(more, [[-3.0] * s.response_length for s in more])
    mt.train_step(more)
    resumed.train_step(more)
    assert all(torch.equal(a, b) for a, b in zip(mt.routes.trainable(), resumed.routes.trainable()))
    # a resumed run trains at the rates it is given, not the saved run's
    faster = MegatronTrainer(tiny_ckpt, policies_cfg(lr=1e-2, policy_lr=["judge=3e-3"]))
    faster.load(tmp_path / "ckpt")
    assert {g["policy"]: g["lr"] for g in faster.optimizer.param_groups} == {"solver": 1e-2, "judge": 3e-3}
    # the policies in another order (each keeps its AdamW state in its place) are refused before anything changes
    other = MegatronTrainer(tiny_ckpt, dataclasses.replace(config, policy=POLICIES[::-1], policy_lr=[]))
    before = [p.detach().clone() for p in other.routes.trainable()]
    with pytest.raises(ValueError, match="in that order"):
        other.load(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(before, other.routes.trainable())) and other.step == 0


def test_fresh_policies_start_as_the_base_apart_and_a_forward_must_be_routed(tiny_ckpt):
    """Fresh adapters (B = 0) start as the base; each policy draws its own A; the router refuses an unrouted forward
    and a sample of no policy."""
    mt = MegatronTrainer(tiny_ckpt, policies_cfg())
    solver, judge = (mt.adapter_weights(n)[0] for n in POLICIES)
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert not torch.equal(solver[a], judge[a]) and all(not v.any() for k, v in solver.items() if "lora_B" in k)
    samples = mixed(6, seed=2)
    lp = mt.compute_log_probs(samples, ref=True)
    assert flat(lp.old).sub(flat(lp.ref)).abs().max() == 0  # B = 0: every policy starts as the base
    with pytest.raises(ValueError, match="policy None"):
        mt.compute_log_probs(make_samples(2, seed=1), ref=False)
    with pytest.raises(RuntimeError, match="outside routing"):
        mt.model(input_ids=torch.zeros(1, 3, dtype=torch.long), position_ids=torch.arange(3)[None], attention_mask=None)


def test_megatron_with_policies_is_a_valid_run(tmp_path):
    run = RunConfig(
        env="agentrl.envs.tictactoe:TicTacToe",
        train=TrainConfig(lora_rank=4, policy=["x_player", "o_player"]),
        rollout=dataclasses.replace(RunConfig().rollout, role_policy=["x=x_player", "o=o_player"]),
        weight_sync="adapter",
        hf_checkpoint=str(tmp_path),
        train_backend="megatron",
    )
    run.validate()


# ---------------------------------------------------------------- two processes: TP=2, PP=2

LAYOUTS = {
    "tp2": MegatronParallel(tensor_model_parallel_size=2),
    "pp2": MegatronParallel(pipeline_model_parallel_size=2),
    "dp2": MegatronParallel(),
}
# DP: two steps of 4 samples; each replica takes its half of each step (as the runtime shards). Rank 0's halves hold
# no judge sample: its judge adapter gets a zero gradient that the data-parallel sum adds to rank 1's
DP_POLICIES = ["solver", "solver", "judge", "solver", "solver", "solver", "judge", "judge"]


def dp_samples():
    return [dataclasses.replace(s, policy=p) for s, p in zip(make_samples(8, seed=5), DP_POLICIES)]


def shard(samples: list, name: str, rank: int) -> list:
    return [s for k in (0, 4) for s in samples[k + 2 * rank : k + 2 * rank + 2]] if name == "dp2" else samples


def unshard(both: list, name: str, rank: int) -> list:
    """Both ranks' per-sample results in the whole batch's order (DP), or this rank's (TP/PP peers agree)."""
    if name == "dp2":
        return [v for k in (0, 2) for r in (0, 1) for v in both[r][k : k + 2]]
    assert both[0] == both[1], name
    return both[rank]


def _worker(rank: int, port: int, ckpt: str, start: str, out: str) -> None:
    from pathlib import Path

    import torch.distributed as dist

    from agentrl.trainer.megatron_compat import destroy_megatron_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for name, layout in LAYOUTS.items():
        whole = dp_samples() if name == "dp2" else mixed(10, seed=4)
        mt = MegatronTrainer(ckpt, policies_cfg(), rank=rank, world_size=2, parallel=layout)
        load_start(mt, Path(start))
        lp = mt.compute_log_probs(shard(whole, name, rank), ref=True)
        both: list = [None, None]
        dist.all_gather_object(both, (lp.old, lp.ref))
        old = unshard([b[0] for b in both], name, rank)
        ref = unshard([b[1] for b in both], name, rank)
        grads = recorded_grads(mt, lambda mt=mt: megatron_grads(mt))
        # the old log-probs' noise drawn over the whole batch, as the reference draws it, then sharded
        metrics = mt.train_step(shard(off_policy(whole, old), name, rank))
        mt.save(f"{out}.{name}.ckpt")
        results[name] = {"old": old, "ref": ref, "metrics": metrics}
        if rank == 0:
            torch.save({"grads": grads}, f"{out}.{name}.pt")
        destroy_megatron_parallel()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def test_two_processes_tp2_pp2_and_dp2_match_the_torch_policies(tiny_ckpt, tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    want_mixed = reference_run(start_adapter(tiny_ckpt, tmp_path / "start", policies_cfg()), mixed(10, seed=4))
    # DP's reference: the same start (loaded), the whole batch on one rank
    dp_reference = TorchTrainer(tiny_ckpt, policies_cfg())
    dp_reference.load(tmp_path / "start")
    want_dp = reference_run(dp_reference, dp_samples())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "results.json")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two ranks on two cores
    mp.spawn(_worker, args=(port, str(tiny_ckpt), str(tmp_path / "start"), out), nprocs=2, join=True)
    results = json.loads(open(out).read())
    for name in LAYOUTS:
        r, want = results[name], (want_dp if name == "dp2" else want_mixed)
        torch.testing.assert_close(flat(r["old"]), flat(want["old"]), rtol=0, atol=TOL, msg=name)
        torch.testing.assert_close(flat(r["ref"]), flat(want["ref"]), rtol=0, atol=TOL, msg=name)
        assert_matches(r["metrics"], torch.load(f"{out}.{name}.pt")["grads"], want, name)
        for policy in POLICIES:  # rank 0 wrote each whole adapter (both TP halves, both stages)
            folder = tmp_path / f"results.json.{name}.ckpt" / POLICIES_DIR / policy
            got = load_file(str(folder / "adapter_model.safetensors"))
            assert_close_dicts(got, want["adapter"][policy], STEPPED, f"{name} {policy}")


# ---------------------------------------------------------------- end to end


def test_agentrl_train_megatron_tp2_with_two_policies_seats_each_role_and_resumes(tiny_ckpt, tmp_path, ray_local):
    """`agentrl train --train-backend megatron --tensor-model-parallel-size 2 --policy x_player --policy o_player`: the
    duet's seats on their own policies; each push gathers both adapters from the TP halves and the embedded engine
    serves them by name, so each seat samples on its policy's adapter (--true-on-policy-mode: the trainer's log-probs
    equal the engine's); both policies train at their own rates; the checkpoint holds adapters/NAME; --load resumes."""
    from agentrl.runtime.train import train
    from tests.test_train import _cfg, _lines

    save = tmp_path / "run"
    kw = dict(
        env="tests.test_policies:Duet",
        train_backend="megatron",
        trainer_num_procs=2,
        save_interval=1,
        true_on_policy_mode=True,
        weight_sync="adapter",
        train={
            "lora_rank": 4,
            "lr": 2e-2,
            "policy": ["x_player", "o_player"],
            "policy_lr": ["o_player=1e-2"],
            "tensor_model_parallel_size": 2,
        },
        rollout={"role_policy": ["a=x_player", "b=o_player"], "max_turns": 4, "rollout_max_turn_len": 40},
    )
    summary = train(_cfg(tiny_ckpt, save, num_rollout=2, **kw))
    assert summary["weight_sync"] == ["adapter"] and summary["weight_version"] == 2
    lines = _lines(save)
    for line in lines:
        assert line["true_on_policy_logprob_diff_max"] < 1e-3  # from the second step on, two adapters that differ
        assert line["grad_norm/x_player"] > 0 and line["grad_norm/o_player"] > 0
        assert line["lr/x_player"] == 2e-2 and line["lr/o_player"] == 1e-2
        assert line["reward_mean/x_player"] == line["reward_mean/a"]
    for name in ("x_player", "o_player"):
        tensors = load_file(str(save / "iter_0000002" / POLICIES_DIR / name / "adapter_model.safetensors"))
        assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (64, 4)  # whole
    summary = train(_cfg(tiny_ckpt, save, num_rollout=3, load=str(save), **kw))
    assert summary["weight_version"] == 3
    lines = _lines(save)
    assert [line["step"] for line in lines] == [0, 1, 2] and lines[-1]["true_on_policy_logprob_diff_max"] < 1e-3
