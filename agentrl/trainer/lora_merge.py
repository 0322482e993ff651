"""``agentrl merge-lora``: a PEFT adapter folded into its base, written as a plain Hugging Face checkpoint.

Why a command: a LoRA run's ``iter_N/`` is already a merged HF folder (its ``adapter/`` beside it), but a run of
several policies (``--policy``) keeps the base there and each policy as ``adapters/NAME``, and an SFT warm start
with ``--lora-rank`` is an adapter too. An engine without LoRA, an eval harness, another framework or the next run
wants each of them as a model of its own. PEFT's ``merge_and_unload`` does this in a notebook; this writes it the
way agentrl writes checkpoints (fp32 safetensors, the base's config, generation config and tokenizer files), and
refuses what would produce a wrong model or overwrite one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn

from agentrl.trainer.lora import ADAPTER_DIR, ADAPTER_NAME, POLICIES_DIR, merged_weights, read_adapter
from agentrl.trainer.torch_trainer import save_hf_metadata


def _adapter_folder(adapter: Path) -> Path:
    """``adapter`` itself when it is a PEFT folder; a run's ``iter_N`` of one LoRA policy: its ``adapter/``."""
    if (adapter / "adapter_config.json").is_file():
        return adapter
    if (adapter / ADAPTER_DIR / "adapter_config.json").is_file():
        return adapter / ADAPTER_DIR
    if (adapter / POLICIES_DIR).is_dir():
        names = sorted(p.name for p in (adapter / POLICIES_DIR).iterdir() if p.is_dir())
        raise ValueError(
            f"adapter {adapter}: a checkpoint of several policies ({', '.join(names) or 'none saved'}): merge one, "
            f"e.g. {adapter / POLICIES_DIR / (names[0] if names else 'NAME')}"
        )
    raise ValueError(
        f"adapter {adapter}: no PEFT adapter folder (adapter_config.json + adapter_model.safetensors), nor a run's "
        f"iter_N holding one in {ADAPTER_DIR}/"
    )


def merge_adapter(adapter: str | Path, out: str | Path, base: str | Path | None = None) -> Path:
    """Write ``out``: the HF checkpoint of ``base`` with the LoRA adapter ``adapter`` folded in (``W + scaling B A``
    for every adapted linear; fp32 ``model.safetensors``), which ``from_pretrained`` and ``--hf-checkpoint`` load.

    ``adapter``: a PEFT folder (``iter_N/adapters/NAME``, ``iter_N/adapter``) or a one-policy run's ``iter_N``.
    ``base``: by default the folder the adapter names as ``base_model_name_or_path`` (agentrl writes the absolute
    path of its ``--hf-checkpoint``); only a local folder is read, nothing is fetched from a model hub. Refused,
    naming the value, before anything is written: no LoRA adapter, no local base, an adapter of other modules or
    shapes than the base has, what this fold would get wrong (a ``lora_B`` bias, Conv1D layers, DoRA, a head tied to
    the embeddings, ``modules_to_save``), and an ``out`` that exists and is not empty (nothing is overwritten). The
    folder is written beside ``out`` and renamed onto it, so a failure leaves no half-written ``out``.
    """
    from transformers import AutoModelForCausalLM

    folder = _adapter_folder(Path(adapter))
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ValueError(f"adapter {folder}: adapter_model.safetensors is missing")
    try:
        saved = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"adapter {folder}: adapter_config.json is unreadable ({exc})") from None
    if not isinstance(saved, dict) or saved.get("peft_type") != "LORA":
        kind = saved.get("peft_type") if isinstance(saved, dict) else None
        raise ValueError(f"adapter {folder}: adapter_config.json describes no LoRA adapter (peft_type {kind!r})")
    if base is None:
        named = saved.get("base_model_name_or_path")
        if not isinstance(named, str) or not named:
            raise ValueError(
                f"adapter {folder} names no base_model_name_or_path: pass the base it was trained on as --base"
            )
        base = named
    base_path = Path(base)
    if not (base_path / "config.json").is_file():
        raise ValueError(
            f"--base {base}: no local Hugging Face checkpoint folder (config.json); pass the folder the adapter was "
            "trained on (nothing is fetched from a model hub)"
        )
    out_path = Path(out)
    if out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir())):
        raise FileExistsError(
            f"--out {out_path} exists and is not an empty folder: name a new one (nothing is overwritten)"
        )
    if out_path.resolve() == base_path.resolve():
        raise ValueError(f"--out {out_path} is the base itself: name a new folder")

    for key, what in (("lora_bias", "a bias on lora_B"), ("fan_in_fan_out", "Conv1D layers (fan_in_fan_out)")):
        if saved.get(key):
            raise ValueError(
                f"adapter {folder}: {what} is not folded in by merge-lora; PEFT's merge_and_unload does it"
            )
    try:
        model = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--base {base_path}: its model does not load ({exc})") from None
    config = LoraConfig.from_pretrained(str(folder))
    config.inference_mode = True
    get_peft_model(model, config)  # PEFT's layers in place, under the name read_adapter maps to
    embeddings = id(model.get_input_embeddings().weight)
    for name, m in model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        base_layer = m.get_base_layer()
        if not isinstance(base_layer, nn.Linear):
            raise ValueError(f"adapter {folder} adapts {name}, a {type(base_layer).__name__}: merge-lora folds linears")
        if id(base_layer.weight) == embeddings:
            raise ValueError(
                f"adapter {folder} adapts {name}, whose weight is tied to the input embeddings: folding it in would "
                "change both; merge-lora refuses it"
            )
    try:
        state = read_adapter(model, folder)
    except ValueError as exc:
        raise ValueError(
            f"{exc}: merge-lora folds plain LoRA adapters of the base's linear layers (not DoRA magnitudes, "
            "modules_to_save or embedding layers), on the base they were trained on"
        ) from None
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip()
        raise ValueError(
            f"adapter {folder} does not fit --base {base_path} ({first}): pass the base it was trained on"
        ) from None
    from safetensors.torch import save_file

    tensors = {name: t.detach().cpu().contiguous() for name, t in merged_weights(model, ADAPTER_NAME)}
    # written beside --out, then renamed onto it: a failure leaves no half-written --out behind
    out_path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    try:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        save_hf_metadata(model, base_path, staging, torch.float32)
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # (mkdtemp's folder is private)
        os.replace(staging, out_path)  # (onto an empty folder too)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_path


__all__ = ["merge_adapter"]
