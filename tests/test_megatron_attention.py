"""PackedCoreAttention: per-sample attention in a packed row equals megatron's masked T x T attention.

Reference everywhere is megatron's own ``DotProductAttention`` given the block-causal mask of
``packed_attention_mask`` (the path the trainer used before), or each sample run alone. Lengths
include equal-length samples (stacked into one SDPA call), a one-token sample and GQA layouts.
"""

from __future__ import annotations

import socket

import pytest
import torch

from agentrl.trainer.megatron_compat import megatron_available

_REASON = megatron_available()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from agentrl.trainer import megatron_attention  # noqa: E402
from agentrl.trainer import megatron_model as mm  # noqa: E402
from agentrl.trainer.megatron_attention import PackedCoreAttention, packed_seq_params, segment_bounds  # noqa: E402
from agentrl.trainer.megatron_compat import apply_cpu_workarounds, destroy_megatron_parallel, init_megatron_parallel  # noqa: E402

LENGTHS = [5, 7, 5, 1, 12, 7]  # 37 tokens; 5 and 7 twice: equal lengths share one SDPA call


@pytest.fixture(scope="module")
def megatron_world():
    """torch.distributed (gloo, world 1) + megatron parallel state tp=pp=cp=1, once for this module."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip("another test left a torch.distributed group of world size > 1 running")
    apply_cpu_workarounds()
    init_megatron_parallel(1, 1, 1, seed=1234)
    yield
    destroy_megatron_parallel()
    if created:
        dist.destroy_process_group()


def _modules(heads: int, groups: int, head_dim: int = 16, layer_number: int = 1, **extra):
    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        **extra,
    )
    kw = dict(
        config=config,
        layer_number=layer_number,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        softmax_scale=config.softmax_scale,
    )
    return PackedCoreAttention(**kw), DotProductAttention(**kw)


def _qkv(lengths, heads, groups, head_dim=16, b=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return [(2 * torch.randn(t, b, n, head_dim, generator=g)).requires_grad_() for n in (heads, groups, groups)]


def _positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None]


def _grads(out, inputs, seed=1):
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, upstream)


@pytest.mark.parametrize("heads,groups,expand", [(4, 4, False), (4, 2, False), (4, 1, False), (4, 2, True)])
def test_per_sample_attention_equals_block_causal_dot_product_attention(
    megatron_world, monkeypatch, heads, groups, expand
):
    if expand:  # GQA by repeating k/v heads, the path taken on CUDA (CPU uses SDPA's enable_gqa)
        monkeypatch.setattr(megatron_attention, "_SDPA_HAS_GQA", False)
    packed, reference = _modules(heads, groups)
    qkv = _qkv(LENGTHS, heads, groups)
    out = packed(*qkv, None, packed_seq_params=packed_seq_params(_positions(LENGTHS)))
    expected = reference(*qkv, mm.packed_attention_mask(LENGTHS))
    assert out.shape == expected.shape == (sum(LENGTHS), 1, heads * 16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(_grads(out, qkv), _grads(expected, qkv)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_segments_it_is_causal_or_follows_the_given_mask(megatron_world):
    packed, reference = _modules(4, 2)
    qkv = _qkv([9], 4, 2, b=2)
    torch.testing.assert_close(packed(*qkv, None), reference(*qkv, None), rtol=1e-5, atol=1e-5)
    mask = mm.packed_attention_mask([4, 5])  # the T x T fallback path: the mask alone decides
    torch.testing.assert_close(packed(*qkv, mask), reference(*qkv, mask), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        packed(*qkv, mask, packed_seq_params=packed_seq_params(_positions([4, 5])))


def test_softmax_scale_and_query_key_layer_scaling_match_megatron(megatron_world):
    for extra, layer in (({"softmax_scale": 0.3}, 1), ({"apply_query_key_layer_scaling": True}, 3)):
        packed, reference = _modules(4, 2, layer_number=layer, **extra)
        qkv = _qkv(LENGTHS, 4, 2, seed=layer)
        out = packed(*qkv, None, packed_seq_params=packed_seq_params(_positions(LENGTHS)))
        torch.testing.assert_close(out, reference(*qkv, mm.packed_attention_mask(LENGTHS)), rtol=1e-5, atol=1e-5)
    plain, _ = _modules(4, 2, head_dim=24)
    assert plain.softmax_scale == pytest.approx(24**-0.5)


def test_attention_does_not_leak_across_samples(megatron_world):
    """Each sample's output and gradients depend on its own tokens only (and the check can fail)."""
    packed, _ = _modules(4, 2)
    params = packed_seq_params(_positions(LENGTHS))
    q, k, v = _qkv(LENGTHS, 4, 2)
    bounds = segment_bounds(params, sum(LENGTHS))
    for j, (s, e) in enumerate(bounds):
        out = packed(q, k, v, None, packed_seq_params=params)
        grads = torch.autograd.grad(out[s:e].square().sum(), (q, k, v))
        for g in grads:
            outside = torch.cat([g[:s], g[e:]])
            assert torch.count_nonzero(outside) == 0, f"sample {j} reads other samples' q/k/v"
            assert g[s:e].abs().sum() > 0 or e - s == 1
    # perturbing the keys/values of sample 0 leaves every other sample's output bit-identical
    base = packed(q, k, v, None, packed_seq_params=params).detach()
    end0 = bounds[0][1]
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:end0] += 1.0
    v2[:end0] -= 1.0
    moved = packed(q, k2, v2, None, packed_seq_params=params).detach()
    assert torch.equal(moved[end0:], base[end0:]) and not torch.allclose(moved[:end0], base[:end0])
    # the same probe run over the whole row (no segments) does see the perturbation
    whole = packed(q, k2, v2, None).detach()
    assert not torch.allclose(whole[end0:], packed(q, k, v, None).detach()[end0:])


def test_packed_seq_params_from_position_ids():
    params = packed_seq_params(_positions([3, 1, 4]))
    assert params.qkv_format == "sbhd" and params.cu_seqlens_q.tolist() == [0, 3, 4, 8]
    assert params.max_seqlen_q == params.max_seqlen_kv == 8  # megatron sizes the RoPE table by it: the row
    assert params.cu_seqlens_q.device.type == "cpu"
    assert segment_bounds(params, 10) == [(0, 3), (3, 4), (4, 8), (8, 10)]  # a padded tail is its own segment
    with pytest.raises(ValueError, match="rise strictly"):
        segment_bounds(params, 6)
    params.qkv_format = "thd"
    with pytest.raises(ValueError, match="sbhd"):
        segment_bounds(params, 8)


# -- through the whole GPTModel ------------------------------------------------------------------


def _hf_config():
    from transformers import Qwen3Config

    # GQA (4 heads, 2 groups), head_dim 24 != hidden/heads, q/k norms
    return Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=300,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )


def _model(packed_attention: bool = True):
    config = _hf_config()
    torch.manual_seed(0)
    model = mm.build_gpt_model(config, mm.transformer_config_from_hf(config), packed_attention=packed_attention)
    with torch.no_grad():  # O(1) activations: a leak between samples moves logits far beyond the tolerance
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(0, 1.0 if "embedding" in name else p.shape[1] ** -0.5)
    return model


def test_build_gpt_model_swaps_in_packed_attention(megatron_world):
    packed, plain = _model(True), _model(False)
    kinds = {type(layer.self_attention.core_attention) for layer in packed.decoder.layers}
    assert kinds == {PackedCoreAttention}
    assert {type(layer.self_attention.core_attention) for layer in plain.decoder.layers} == {DotProductAttention}
    assert packed.state_dict().keys() == plain.state_dict().keys()
    # the norms are torch's RMSNorm whatever is installed (apex's FusedLayerNorm refuses RMSNorm; TE renames)
    norms = [packed.decoder.final_layernorm] + [
        m for layer in packed.decoder.layers for m in (layer.input_layernorm, layer.pre_mlp_layernorm)
    ]
    assert all(type(n) is torch.nn.RMSNorm for n in norms), {type(n) for n in norms}


def test_packed_row_through_the_model_equals_each_sample_alone(megatron_world):
    model = _model().train()
    lengths = [6, 9, 6, 11]
    g = torch.Generator().manual_seed(3)
    samples = [torch.randint(0, 300, (n,), generator=g) for n in lengths]
    row = torch.cat(samples)[None]
    pos = _positions(lengths)

    def loss_of(logits, ids):  # next-token cross entropy of one sample's logits [1, n, V]
        return torch.nn.functional.cross_entropy(logits[0, :-1, :300], ids[1:], reduction="sum")

    packed = model(row, pos, None, packed_seq_params=packed_seq_params(pos))
    sum(loss_of(packed[:, s:e], x) for x, (s, e) in zip(samples, segment_bounds(packed_seq_params(pos), 32))).backward()
    packed_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    alone = [model(x[None], torch.arange(len(x))[None], None) for x in samples]
    sum(loss_of(a, x) for a, x in zip(alone, samples)).backward()
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=1e-4, atol=1e-4)
    for k, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[k], p.grad, rtol=1e-4, atol=1e-4, msg=k)
    # the comparison can fail: the same row without segments lets later samples see earlier ones
    with torch.no_grad():
        leaky = model(row, pos, None)
    assert not torch.allclose(leaky[:, lengths[0] :], torch.cat(alone[1:], dim=1), atol=1e-3)
