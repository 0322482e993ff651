"""``agentrl merge-lora`` (issue 40): a policy's PEFT adapter folded into its base as a plain HF checkpoint.

What each test pins down: a policy of a run of several policies and a one-policy run's adapter each merge into a
folder that ``from_pretrained`` loads to the log-probs PEFT's own ``PeftModel`` gives (and, for one policy, to the
merged model the run wrote itself), tied embeddings included; bad input is refused naming the value, before
anything is written.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from agentrl.cli import main
from agentrl.trainer.lora import ADAPTER_DIR, POLICIES_DIR
from agentrl.trainer.torch_trainer import TorchTrainer
from tests.test_trainer import cfg, make_samples, reference_log_probs


def _randomize(trainer: TorchTrainer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def _load(folder) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.mark.parametrize("base", ["tiny_ckpt", "tied_ckpt"])
def test_each_policy_merges_into_a_checkpoint_with_peft_log_probs(base, request, tmp_path, capsys):
    ckpt = request.getfixturevalue(base)
    trainer = TorchTrainer(ckpt, cfg(lora_rank=4, lora_alpha=8.0, policy=["solver", "judge"]))
    _randomize(trainer, seed=1)
    trainer.save(tmp_path / "iter_1")
    samples = make_samples(3, seed=2)
    merged = {}
    for name in ("solver", "judge"):
        folder = tmp_path / "iter_1" / POLICIES_DIR / name
        assert main(["merge-lora", str(folder), "--out", str(tmp_path / name)]) == 0
        assert str(tmp_path / name) in capsys.readouterr().out
        merged[name] = _load(tmp_path / name)
        peft_model = PeftModel.from_pretrained(_load(ckpt), str(folder)).eval()
        for s in samples:
            torch.testing.assert_close(
                reference_log_probs(merged[name], s), reference_log_probs(peft_model, s), atol=1e-5, rtol=0
            )
        assert (tmp_path / name / "tokenizer.json").is_file() or (tmp_path / name / "tokenizer_config.json").is_file()
    # the two policies' models differ, and differ from the base: each is its own adapter folded in
    base_model = _load(ckpt)
    a, b, plain = (reference_log_probs(m, samples[0]) for m in (merged["solver"], merged["judge"], base_model))
    assert (a - b).abs().max() > 1e-3 and (a - plain).abs().max() > 1e-3


def test_a_one_policy_run_merges_to_the_model_it_wrote(tiny_ckpt, tmp_path):
    trainer = TorchTrainer(tiny_ckpt, cfg(lora_rank=4, lora_alpha=8.0))
    _randomize(trainer, seed=3)
    trainer.save(tmp_path / "iter_1")
    assert main(["merge-lora", str(tmp_path / "iter_1"), "--out", str(tmp_path / "merged")]) == 0  # its adapter/
    ours, its_own = _load(tmp_path / "merged"), _load(tmp_path / "iter_1")
    for s in make_samples(3, seed=4):
        torch.testing.assert_close(reference_log_probs(ours, s), reference_log_probs(its_own, s), atol=1e-6, rtol=0)


def test_bad_input_is_refused_naming_it_and_nothing_is_written(tiny_ckpt, tmp_path, capsys):
    from agentrl.tiny import build_model

    trainer = TorchTrainer(tiny_ckpt, cfg(lora_rank=4, lora_alpha=8.0, policy=["solver", "judge"]))
    trainer.save(tmp_path / "iter_1")
    solver = tmp_path / "iter_1" / POLICIES_DIR / "solver"

    def refused(args: list[str], message: str) -> None:
        assert main(["merge-lora", *args]) == 2
        assert message in capsys.readouterr().err

    refused([str(tmp_path / "iter_1"), "--out", str(tmp_path / "o1")], "several policies (judge, solver)")
    refused([str(tmp_path), "--out", str(tmp_path / "o2")], "no PEFT adapter folder")
    full = tmp_path / "not_a_run"
    full.mkdir()
    refused([str(full), "--out", str(tmp_path / "o3")], "no PEFT adapter folder")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("the user's")
    refused([str(solver), "--out", str(taken)], "exists and is not an empty folder")
    assert (taken / "keep.txt").read_text() == "the user's" and len(list(taken.iterdir())) == 1
    refused([str(solver), "--out", str(tmp_path / "o4"), "--base", str(tmp_path / "nowhere")], "--base")
    other = build_model(tmp_path / "wider", hidden_size=96)  # same modules, other shapes
    refused([str(solver), "--out", str(tmp_path / "o5"), "--base", str(other)], "does not fit --base")
    prefix = tmp_path / "prefix"
    shutil.copytree(solver, prefix)
    config = json.loads((prefix / "adapter_config.json").read_text())
    (prefix / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "PREFIX_TUNING"}))
    refused([str(prefix), "--out", str(tmp_path / "o6")], "describes no LoRA adapter")
    (prefix / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    refused([str(prefix), "--out", str(tmp_path / "o7")], "names no base_model_name_or_path")
    (prefix / "adapter_model.safetensors").unlink()
    refused([str(prefix), "--out", str(tmp_path / "o8")], "adapter_model.safetensors is missing")
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 9))
    assert (tmp_path / "iter_1" / ADAPTER_DIR).exists() is False  # (a checkpoint of policies has no adapter/)


def test_adapters_this_fold_would_get_wrong_are_refused(tied_ckpt, tmp_path, capsys):
    """PEFT can save adapters that ``W + scaling B A`` alone does not reproduce: a ``lora_B`` bias, and a LoRA on a
    head tied to the embeddings (folding it in would change the embeddings too). Each refused, nothing written."""
    from peft import LoraConfig, get_peft_model

    cases = {
        "bias": (LoraConfig(r=4, target_modules="all-linear", lora_bias=True), {}, "a bias on lora_B"),
        "tied": (
            LoraConfig(r=4, target_modules=["q_proj", "lm_head"]),
            {"save_embedding_layers": False},
            "tied to the input embeddings",
        ),
    }
    for name, (config, save_kw, message) in cases.items():
        peft_model = get_peft_model(_load(tied_ckpt), config)
        peft_model.save_pretrained(str(tmp_path / name), **save_kw)
        assert (
            main(["merge-lora", str(tmp_path / name), "--out", str(tmp_path / f"{name}-out"), "--base", str(tied_ckpt)])
            == 2
        )
        assert message in capsys.readouterr().err
        assert not (tmp_path / f"{name}-out").exists()


def test_a_failed_write_leaves_no_half_written_folder(tiny_ckpt, tmp_path, monkeypatch):
    import agentrl.trainer.lora_merge as lora_merge

    trainer = TorchTrainer(tiny_ckpt, cfg(lora_rank=4, lora_alpha=8.0))
    trainer.save(tmp_path / "iter_1")

    def full_disk(*args, **kwargs):  # fault injection: the metadata write fails after the weights were written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lora_merge, "save_hf_metadata", full_disk)
    (tmp_path / "out").mkdir()  # an empty folder the user made for it
    assert main(["merge-lora", str(tmp_path / "iter_1"), "--out", str(tmp_path / "out")]) == 2
    assert list((tmp_path / "out").iterdir()) == [] and not list(tmp_path.glob(".out.*"))
    monkeypatch.undo()
    assert main(["merge-lora", str(tmp_path / "iter_1"), "--out", str(tmp_path / "out")]) == 0  # the retry is taken
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out").stat().st_mode & 0o755 == 0o755
