"""Tiny random-init models and tokenizers built locally, for tests, examples and benchmarks.

Nothing may be downloaded from a model hub, so tests build their own: a byte-level BPE tokenizer
trained in a fraction of a second on a small built-in corpus (lossless: any text round-trips), with
ChatML special tokens, and a 2-layer Llama. The model is "chatty": a constant direction in the
token embeddings plus a matching row in the output head give the end-of-turn token a fixed logit
boost, so sampled turns end after ~``mean_turn_tokens`` tokens instead of running to the length
limit. That makes multi-turn episodes possible with an untrained model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Plain ChatML without tool support (like SmolLM2's own template)."""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = """
The quick brown fox jumps over the lazy dog. What is 12 plus 30? The answer is 42.
<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> <tool_response>3</tool_response>
You are a helpful assistant. Use the tools to compute the answer. Call a tool with JSON.
{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}} 0123456789 + - * / ( ) = ?
system user assistant tool function parameters description type object string number integer
"""


def build_tokenizer(out_dir: str | Path, *, vocab_size: int = 400, chat_template: str = CHATML_TEMPLATE):
    """Train and save a byte-level BPE tokenizer with ChatML special tokens; return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = chat_template
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def build_model(
    out_dir: str | Path,
    *,
    vocab_size: int = 400,
    hidden_size: int = 64,
    num_layers: int = 2,
    mean_turn_tokens: float = 12.0,
    seed: int = 0,
    chat_template: str = CHATML_TEMPLATE,
) -> Path:
    """Build a tiny chatty Llama checkpoint (safetensors + tokenizer) in ``out_dir``; return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size, chat_template=chat_template)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg).eval()
    eos = tok.eos_token_id
    _make_chatty(model, model.model, eos, mean_turn_tokens)
    _save(model, out, tok, mean_turn_tokens, seed)
    return out


VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML whose image parts render as Idefics3's ``<image>`` marker (the processor expands it)."""


def build_vlm(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    image_size: int = 32,
    patch_size: int = 8,
    mean_turn_tokens: float = 12.0,
    seed: int = 0,
    split_images: bool = False,
) -> Path:
    """Build a tiny Idefics3 (SmolVLM's architecture) checkpoint with its processor in ``out_dir``.

    A SigLIP vision tower (one layer) and a pixel-shuffle connector in front of the chatty 2-layer Llama
    of :func:`build_model`; images are resized to ``image_size`` pixels (no splitting), so each image is
    ``(image_size / patch_size)**2 / 4`` placeholder tokens (4 by default). ``split_images``: as SmolVLM's
    own processor, an image larger than ``image_size`` is cut into ``image_size`` crops (up to 2x2 here)
    plus a downscaled global view, each crop its own run of placeholders. The output head never favours
    the ``<image>`` placeholder (a large negative logit), as a trained VLM never emits it.
    """
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    out = Path(out_dir)
    tok = build_tokenizer(out, chat_template=VLM_CHAT_TEMPLATE)
    # SmolVLM's tokenizer has these as added tokens; Idefics3Processor adds only the first two itself
    crops = [f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)]  # split images name their crops
    tok.add_special_tokens(
        {"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<global-img>", *crops]}
    )
    images = Idefics3ImageProcessorPil(
        do_image_splitting=split_images,
        size={"longest_edge": 2 * image_size if split_images else image_size},
        max_image_size={"longest_edge": image_size},
    )
    scale = 2
    seq_len = (image_size // patch_size) ** 2 // scale**2
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tok, image_seq_len=seq_len, chat_template=VLM_CHAT_TEMPLATE
    )
    processor.save_pretrained(out)
    torch.manual_seed(seed)
    text = {
        "model_type": "llama",
        "vocab_size": len(tok),
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": image_size,
        "patch_size": patch_size,
    }
    image_token = tok.convert_tokens_to_ids("<image>")
    cfg = Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=scale,
        image_token_id=image_token,
        tie_word_embeddings=False,
    )
    model = Idefics3ForConditionalGeneration(cfg).eval()
    eos = tok.eos_token_id
    body = model.model.text_model
    h0 = _make_chatty(model, body, eos, mean_turn_tokens)
    with torch.no_grad():  # the placeholder's logit far below the others: never sampled
        model.lm_head.weight[image_token, 0] = -30.0 / h0
    _save(model, out, tok, mean_turn_tokens, seed)
    return out


def _make_chatty(model: Any, body: Any, eos: int, mean_turn_tokens: float) -> float:
    """Give the end-of-turn token a near-constant logit so P(eos) ~ 1 / ``mean_turn_tokens``; return h[0].

    Dimension 0 of every embedding is a constant 1.0, which dominates the residual stream's RMS, so after
    the final RMSNorm h[0] ~ sqrt(hidden). A weight on that dimension in the EOS row of the head then adds
    a near-constant logit.
    """
    import torch

    vocab = body.embed_tokens.weight.shape[0]
    with torch.no_grad():
        body.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        probe = torch.randint(0, vocab, (1, 64))
        h0 = body(probe).last_hidden_state[0, :, 0].mean().item()
        target = math.log((vocab - 1) / max(mean_turn_tokens - 1.0, 1e-3))
        model.lm_head.weight[eos, 0] = target / h0
    return h0


def _save(model: Any, out: Path, tok: Any, mean_turn_tokens: float, seed: int) -> None:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    (out / "agentrl_tiny.json").write_text(json.dumps({"mean_turn_tokens": mean_turn_tokens, "seed": seed}))
