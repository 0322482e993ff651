"""LoRA on the ``torch`` backend: a PEFT adapter over the frozen base, merged for the engines, saved as PEFT saves it.

``--lora-rank r`` wraps the policy's linear layers in PEFT's LoRA layers (the field's library: agentrl writes no
LoRA layer of its own), so only the adapters' ``A`` and ``B`` train and only they carry AdamW state. Three things
around the adapter are agentrl's:

* **the reference** for a KL term is the base with the adapters disabled (``disable_adapter``): no second model;
* **the engines** receive the merged weights ``W + (alpha / r) B A`` under the base's Hugging Face names
  (:func:`merged_weights`), so every engine and weight transport serves a LoRA run unchanged; or, with
  ``--weight-sync adapter``, the adapter alone (:func:`adapter_state`, :func:`adapter_config_dict`), which embedded
  engines serve on their unchanged base;
* **checkpoints** keep the loadable merged folder every reader of a run folder expects and add the adapter in
  PEFT's format under ``adapter/`` (``adapter_config.json`` + ``adapter_model.safetensors``), which
  ``peft.PeftModel.from_pretrained(base, "iter_N/adapter")`` and SGLang's ``--lora-paths NAME=iter_N/adapter``
  load. A resumed run restores the adapter (and its optimizer) onto the same base.

The megatron backend trains the same adapter (PEFT's names and files, this module's config, checks and checkpoint
folder) on megatron's tensor-parallel linears: :mod:`agentrl.trainer.megatron_lora`.

Targets are linear layers only (PEFT's ``all-linear`` by default, which leaves out the LM head); PiSSA-style
initialisations that rewrite the base weights are not offered, since the reference and the merge read the base.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from torch import nn

from agentrl.config import TrainConfig

ADAPTER_DIR = "adapter"
"""Where a LoRA run's checkpoint keeps its adapter in PEFT's format (beside the merged model)."""
ADAPTER_NAME = "default"
"""PEFT's name for the one adapter a trainer holds."""
PEFT_PREFIX = "base_model.model."
"""PEFT's prefix of an adapter tensor's name in ``adapter_model.safetensors``."""
POLICIES_DIR = "adapters"
"""Where a checkpoint of several policies (``--policy``) keeps each policy's adapter: ``iter_N/adapters/NAME``."""


def _all_linear(cfg: TrainConfig) -> bool:
    """Whether the targets are PEFT's ``all-linear`` (named, or by default)."""
    return list(cfg.lora_target_modules) in ([], ["all-linear"])


def lora_config(cfg: TrainConfig) -> LoraConfig:
    """PEFT's ``LoraConfig`` for the train flags: rank, alpha (default: the rank), dropout, targets, init."""
    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha if cfg.lora_alpha is not None else cfg.lora_rank,
        lora_dropout=cfg.lora_dropout,
        # PEFT reads the shorthand only as a string (a list is module names)
        target_modules=("all-linear" if _all_linear(cfg) else list(cfg.lora_target_modules)),
        init_lora_weights=True if cfg.lora_init == "default" else cfg.lora_init,
        bias="none",
        task_type="CAUSAL_LM",
    )


def add_lora(model: nn.Module, cfg: TrainConfig, base_path: str | Path) -> PeftModel:
    """Wrap ``model`` (its layers in place) in a LoRA adapter; the base's weights stop training.

    Returns the ``PeftModel`` (it switches the adapter off for the reference); the caller keeps running
    ``model`` itself, whose targeted linears are now LoRA layers. A target the model lacks, or one that is
    not a linear layer, is refused naming ``--lora-target-modules``.
    """
    _refuse_targets(model, cfg)
    peft_model = get_peft_model(model, lora_config(cfg))
    peft_model.peft_config[ADAPTER_NAME].base_model_name_or_path = str(Path(base_path).resolve())
    return peft_model


def target_problems(model: nn.Module, cfg: TrainConfig) -> list[str]:
    """What is wrong with ``--lora-target-modules`` / ``--lora-rank`` for ``model`` (may live on the meta device)."""
    wanted = list(cfg.lora_target_modules)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if _all_linear(cfg):
        hit = {n: m for n, m in linears.items() if m is not head}
    else:
        if "all-linear" in wanted:
            return ["--lora-target-modules: all-linear stands alone (it already names every linear layer)"]
        hit = {}
        for target in wanted:
            matched = {n: m for n, m in model.named_modules() if n == target or n.endswith("." + target)}
            if not matched:
                return [
                    f"--lora-target-modules {target}: the model has no such module (its linear layers end in "
                    f"{', '.join(sorted({n.rsplit('.', 1)[-1] for n in linears}))})"
                ]
            wrong = sorted({type(m).__name__ for m in matched.values() if not isinstance(m, nn.Linear)})
            if wrong:
                return [f"--lora-target-modules {target}: LoRA here adapts linear layers, not {', '.join(wrong)}"]
            hit.update(matched)
    if not hit:
        return ["--lora-target-modules: no linear layer to adapt"]
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is not None and embeddings is not None and any(m is head for m in hit.values()):
        if head.weight is embeddings.weight:
            return [
                "--lora-target-modules: this model ties its LM head to its input embeddings, so an adapter on the "
                "head would be merged into both; adapt other modules"
            ]
    # above every adapted layer's own rank an adapter is a full update at more cost (a small router or gate
    # among larger layers is no reason to refuse: its adapter is merely wider than it needs)
    largest = max(min(m.in_features, m.out_features) for m in hit.values())
    if cfg.lora_rank > largest:
        return [
            f"--lora-rank {cfg.lora_rank} is above the rank of every adapted layer (at most {largest}): an adapter "
            "that large is a full update at more cost; lower it"
        ]
    return []


def check_lora(checkpoint: str | Path, cfg: TrainConfig) -> None:
    """Refuse LoRA flags the checkpoint's model cannot take, before any weight loads (a meta-device model)."""
    if not cfg.lora_rank:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(checkpoint), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    _refuse_targets(model, cfg)


def _refuse_targets(model: nn.Module, cfg: TrainConfig) -> None:
    problems = target_problems(model, cfg)
    if problems:
        raise ValueError("; ".join(problems))


def _lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def merged_weights(model: nn.Module, adapter: str | None = ADAPTER_NAME) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under the base's HF names, each adapted linear's as ``W + scaling * B @ A``.

    ``model`` is the HF model holding PEFT's layers (not the ``PeftModel``); ``adapter`` the adapter folded in (None:
    the base alone, as a run of several policies serves it). Sharded (FSDP2): a collective, every rank iterates in
    lockstep and receives full tensors. Tied copies come once (the first name).
    """
    layers = _lora_layers(model)
    state = model.state_dict(keep_vars=True)
    seen: set[int] = set()
    for name, t in state.items():
        if id(t) in seen or ".lora_" in name:
            continue
        seen.add(id(t))
        if ".base_layer." not in name:
            yield name, _full(t)
            continue
        owner, leaf = name.split(".base_layer.", 1)
        w = _full(t)
        if leaf == "weight" and adapter is not None:
            a = _full(state[f"{owner}.lora_A.{adapter}.weight"]).float()
            b = _full(state[f"{owner}.lora_B.{adapter}.weight"]).float()
            w = (w.float() + (b @ a) * layers[owner].scaling[adapter]).to(w.dtype)
        yield f"{owner}.{leaf}", w


def _peft_names(model: nn.Module, adapter: str) -> dict[str, str]:
    """``{PEFT file name: model state name}`` of adapter ``adapter``'s tensors (``...q_proj.lora_A.weight``)."""
    out = {}
    for n in model.state_dict(keep_vars=True):
        for kind in ("lora_A", "lora_B"):
            if f".{kind}.{adapter}." in n:  # (the adapter's name may also be a module's: replace it here only)
                out[PEFT_PREFIX + n.replace(f".{kind}.{adapter}.", f".{kind}.", 1)] = n
    return out


def adapter_state(model: nn.Module, adapter: str = ADAPTER_NAME) -> dict[str, torch.Tensor]:
    """The adapter's tensors in PEFT's file names (``base_model.model.<module>.lora_A.weight``), full and on CPU."""
    state = model.state_dict(keep_vars=True)
    return {peft: _full(state[n]).cpu().contiguous() for peft, n in _peft_names(model, adapter).items()}


def save_adapter(peft_model: PeftModel, model: nn.Module, folder: Path, *, write: bool) -> None:
    """Write ``folder/adapter`` in PEFT's format (a collective when sharded; only ``write`` ranks touch disk)."""
    tensors = adapter_state(model)
    if write:
        write_adapter(folder, tensors, peft_model.peft_config[ADAPTER_NAME])


def write_adapter(folder: Path, tensors: dict[str, torch.Tensor], config: LoraConfig) -> None:
    """``folder/adapter/``: ``adapter_model.safetensors`` (PEFT's tensor names) and ``adapter_config.json``."""
    write_peft_folder(folder / ADAPTER_DIR, tensors, config)


def write_peft_folder(out: Path, tensors: dict[str, torch.Tensor], config: LoraConfig) -> None:
    """``out/``: one adapter as PEFT saves it, ``adapter_model.safetensors`` and ``adapter_config.json``."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))


def adapter_config_dict(config: PeftModel | LoraConfig, adapter: str = ADAPTER_NAME) -> dict[str, Any]:
    """An adapter's ``adapter_config.json`` as a JSON-able dict (sets as sorted lists), as PEFT would write it.

    ``config``: a trainer's ``PeftModel`` (its adapter ``adapter``'s config) or a ``LoraConfig`` (the megatron
    backend's).
    """
    if isinstance(config, PeftModel):
        config = config.peft_config[adapter]
    raw = config.to_dict()
    return json.loads(json.dumps(raw, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o)))


def check_adapter(adapter: Path, cfg: TrainConfig, base: str | Path, *, what: str) -> None:
    """Refuse a PEFT adapter folder this run cannot continue: not an adapter, another rank or scale, another base.

    Reads ``adapter_config.json`` only (no torch), so the preflight runs it before anything starts; ``what`` says
    where the folder came from in the message (``--load RUN``, ``--lora-adapter-path DIR``).
    """
    files = [adapter / "adapter_config.json", adapter / "adapter_model.safetensors"]
    if not all(f.is_file() for f in files):
        raise ValueError(
            f"{what}: {adapter} is no PEFT adapter folder (adapter_config.json + adapter_model.safetensors)"
        )
    try:
        saved = json.loads(files[0].read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what}: {files[0]} is unreadable ({exc})") from None
    if not isinstance(saved, dict) or saved.get("peft_type") != "LORA":
        raise ValueError(f"{what}: {files[0]} describes no LoRA adapter (peft_type {saved.get('peft_type')!r})")
    alpha = cfg.lora_alpha if cfg.lora_alpha is not None else cfg.lora_rank
    for key, flag, mine in (("r", "--lora-rank", cfg.lora_rank), ("lora_alpha", "--lora-alpha", alpha)):
        if saved.get(key) != mine:
            raise ValueError(
                f"{what}: its adapter has {key} {saved.get(key)}, this run's {flag} gives {mine}: pass the flags it "
                "was trained with"
            )
    trained_on = saved.get("base_model_name_or_path")
    if not isinstance(trained_on, str) or Path(trained_on).resolve() != Path(base).resolve():
        raise ValueError(
            f"{what}: its adapter was trained on {trained_on}, this run's base is {base}: pass that base as "
            "--hf-checkpoint (an adapter on other weights, or on a merged checkpoint of its own run, is another model)"
        )


def check_resume(folder: Path, cfg: TrainConfig, base: str | Path, *, what: str, adapted: bool) -> None:
    """A run's ``iter_*`` against this run's LoRA flags: the kinds agree and the adapter is this run's.

    ``adapted``: whether the model resuming holds an adapter (a LoRA run's policy; not ppo's critic beside it).
    A run of several policies (``--policy``) resumes each policy's ``adapters/NAME``.
    """
    several = (Path(folder) / POLICIES_DIR).is_dir()
    if adapted and (cfg.policy or several):
        if not several or not cfg.policy:
            raise ValueError(
                f"{what}: {folder} was saved by a run of "
                + (
                    "several policies (its adapters are in adapters/NAME): resume it with the same --policy flags"
                    if several
                    else "one policy: resume it without --policy"
                )
            )
        saved = read_policy_order(Path(folder))
        if saved != list(cfg.policy):
            raise ValueError(
                f"{what}: {folder} was saved by a run of the policies {saved} (in that order; each keeps its AdamW "
                f"state in that place): resume it with the same --policy flags, not {list(cfg.policy)}"
            )
        for name in cfg.policy:
            check_adapter(Path(folder) / POLICIES_DIR / name, cfg, base, what=f"{what} (--policy {name})")
        return
    if not adapted:
        if is_lora_checkpoint(folder):
            raise ValueError(
                f"{what}: {folder} was saved by a LoRA run (its adapter is in {folder / ADAPTER_DIR}): resume it with "
                "the same --lora-rank and --lora-* flags"
            )
        return
    if not is_lora_checkpoint(folder):
        raise ValueError(
            f"{what}: {folder} holds no LoRA adapter ({ADAPTER_DIR}/): it was saved by a full fine-tuning run; resume "
            "it without --lora-rank"
        )
    check_adapter(folder / ADAPTER_DIR, cfg, base, what=what)


def read_adapter(model: nn.Module, adapter: Path, name: str = ADAPTER_NAME) -> dict[str, torch.Tensor]:
    """``adapter``'s tensors under ``model``'s own names (for its adapter ``name``); refused when it adapts other
    modules than ``model``'s."""
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    names = _peft_names(model, name)
    if set(tensors) != set(names):
        missing, extra = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
        raise ValueError(
            f"{adapter} adapts other modules than this run's --lora-target-modules "
            f"(missing {missing[:3]}, extra {extra[:3]})"
        )
    return {names[k]: v for k, v in tensors.items()}


def apply_adapter(model: nn.Module, state: dict[str, torch.Tensor], world_size: int) -> None:
    """Copy :func:`read_adapter`'s tensors into ``model``'s LoRA layers (sharded or not)."""
    if world_size > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        device = next(model.parameters()).device
        state = {k: v.to(device) for k, v in state.items()}
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        model.load_state_dict(state, strict=False)


def write_policy_order(folder: Path, policies: list[str]) -> None:
    """``folder/adapters/policies.json``: a run's ``--policy`` names in order (its optimizer's groups follow it)."""
    out = folder / POLICIES_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / "policies.json").write_text(json.dumps(list(policies)))


def read_policy_order(folder: Path) -> list[str] | None:
    """The ``--policy`` names a checkpoint of several policies was saved with (None: unreadable or absent)."""
    try:
        names = json.loads((folder / POLICIES_DIR / "policies.json").read_text())
    except (OSError, ValueError):
        return None
    return names if isinstance(names, list) and all(isinstance(n, str) for n in names) else None


def is_lora_checkpoint(folder: str | Path) -> bool:
    """Whether ``folder`` (a run's ``iter_*``) was saved by a LoRA run (one policy's, or several's)."""
    return (Path(folder) / ADAPTER_DIR / "adapter_config.json").is_file() or (Path(folder) / POLICIES_DIR).is_dir()


__all__ = [
    "ADAPTER_DIR",
    "ADAPTER_NAME",
    "PEFT_PREFIX",
    "POLICIES_DIR",
    "add_lora",
    "adapter_config_dict",
    "adapter_state",
    "apply_adapter",
    "check_adapter",
    "check_lora",
    "check_resume",
    "is_lora_checkpoint",
    "read_adapter",
    "lora_config",
    "merged_weights",
    "save_adapter",
    "target_problems",
    "write_adapter",
    "write_peft_folder",
    "write_policy_order",
    "read_policy_order",
]
