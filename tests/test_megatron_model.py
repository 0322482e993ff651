"""The megatron-core model side: HF config -> GPTModel, weights both ways, logits equal to transformers'.

Tiny HF checkpoints (Llama tied/untied, Qwen2 with q/k/v bias, Qwen3 with q/k norm and a head_dim
that is not hidden/heads, Mistral) are built locally with weights scaled so logits are O(1) and with
perturbed norms and biases, so any wrong mapping (a swapped gate/up, a mis-grouped QKV, a norm on
the wrong side) moves the logits far beyond the tolerance. The module runs a world-size-1 gloo group
with megatron's parallel state once; tensor/pipeline parallelism runs in 2 spawned gloo processes.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from agentrl.trainer.megatron_compat import megatron_available

_REASON = megatron_available()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

from agentrl.trainer import megatron_model as mm  # noqa: E402
from agentrl.trainer.megatron_compat import destroy_megatron_parallel, init_megatron_parallel  # noqa: E402

VOCAB = 300  # not a multiple of 128: vocabulary padding is exercised
COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
MODELS = {  # name -> (transformers class names, extra config)
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama_mha": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, num_key_value_heads=4)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=24)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_hf(name: str, out: Path):
    import transformers

    config_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(list(MODELS).index(name))
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed" in pname or "lm_head" in pname:
                p.normal_(0, 1.0)
            else:  # linear [out, in]: unit-variance activations
                p.normal_(0, p.shape[1] ** -0.5)
    model.save_pretrained(out)
    return config, model


@pytest.fixture(scope="module")
def megatron_world():
    """torch.distributed (gloo, world 1) + megatron parallel state tp=pp=cp=1, once for this module."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip("another test left a torch.distributed group of world size > 1 running")
    init_megatron_parallel(1, 1, 1, seed=1234)
    yield
    destroy_megatron_parallel()
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, HF config, HF model)."""
    root = tmp_path_factory.mktemp("megatron_ckpts")
    return {name: (root / name, *_build_hf(name, root / name)) for name in MODELS}


def _megatron(name, checkpoints):
    path, config, _ = checkpoints[name]
    model = mm.build_gpt_model(config, mm.transformer_config_from_hf(config)).eval()
    mm.load_hf_checkpoint(model, path, config)
    return model


def _forward(model, ids, mask=None):
    s = ids.shape[1]
    with torch.no_grad():
        return model(ids, torch.arange(s).expand_as(ids), mask)


IDS = torch.tensor([[5, 17, 250, 3, 99, 42, 7, 280, 11, 64, 1, 200], [8, 8, 150, 299, 0, 12, 77, 31, 4, 5, 6, 7]])


# -- pure conversion -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_hf_megatron_round_trip_is_bit_exact(checkpoints, name, tp, pp):
    _, config, hf = checkpoints[name]
    state = hf.state_dict()
    back = {}
    for stage in range(pp):
        shards = [mm.hf_to_megatron(state, config, tp_rank=r, tp_size=tp, pp_rank=stage, pp_size=pp) for r in range(tp)]
        assert shards[0]["decoder.layers.0.mlp.linear_fc1.weight"].shape[0] == 2 * 96 // tp
        if stage == 0:
            assert shards[0]["embedding.word_embeddings.weight"].shape[0] == mm.padded_vocab_size(VOCAB, tp) // tp
        back.update(mm.megatron_to_hf(shards, config, layer_offset=stage * (2 // pp)))
    expected = {k for k in state if not (config.tie_word_embeddings and k == "lm_head.weight")}
    assert set(back) == expected
    for k in expected:
        assert torch.equal(back[k], state[k]), k


def test_tp_shards_follow_megatron_layouts(checkpoints):
    """QKV per query group [q_g; k_g; v_g] split by groups; fc1 = [gate_r; up_r] on each rank."""
    _, config, hf = checkpoints["qwen2"]
    sd = hf.state_dict()
    shard1 = mm.hf_to_megatron(sd, config, tp_rank=1, tp_size=2)
    d = 16  # head_dim; 4 heads, 2 groups -> rank 1 holds group 1: q heads 2,3, k head 1, v head 1
    a = "model.layers.0.self_attn."
    want = torch.cat(
        [sd[a + "q_proj.weight"][2 * d : 4 * d], sd[a + "k_proj.weight"][d : 2 * d], sd[a + "v_proj.weight"][d : 2 * d]]
    )
    assert torch.equal(shard1["decoder.layers.0.self_attention.linear_qkv.weight"], want)
    m = "model.layers.0.mlp."
    want_fc1 = torch.cat([sd[m + "gate_proj.weight"][48:], sd[m + "up_proj.weight"][48:]])
    assert torch.equal(shard1["decoder.layers.0.mlp.linear_fc1.weight"], want_fc1)
    assert torch.equal(shard1["decoder.layers.0.self_attention.linear_proj.weight"], sd[a + "o_proj.weight"][:, 32:])
    padded = mm.hf_to_megatron(sd, config, tp_rank=1, tp_size=2)["output_layer.weight"]
    assert padded.shape == (256, 64) and torch.equal(padded[: VOCAB - 256], sd["lm_head.weight"][256:])
    assert not padded[VOCAB - 256 :].any()  # padding rows are zero


def test_packed_attention_mask_from_lengths_and_positions():
    by_len = mm.packed_attention_mask([2, 3], seq_len=6)
    by_pos = mm.packed_attention_mask(torch.tensor([[0, 1, 0, 1, 2, 0]]))
    assert by_len.shape == (1, 1, 6, 6) and by_len.dtype == torch.bool
    assert torch.equal(by_len, by_pos)
    allowed = (~by_len[0, 0]).int().tolist()
    assert allowed[1] == [1, 1, 0, 0, 0, 0] and allowed[4] == [0, 0, 1, 1, 1, 0] and allowed[5] == [0] * 5 + [1]
    with pytest.raises(ValueError, match="sum to at most"):
        mm.packed_attention_mask([4, 4], seq_len=6)


# -- against transformers ------------------------------------------------------------------------


def test_parallel_state_init_is_idempotent_and_refuses_other_sizes(megatron_world):
    init_megatron_parallel(1, 1, 1)  # same sizes: a no-op
    with pytest.raises(RuntimeError, match=r"already initialised with \(tp, pp, cp\)=\(1, 1, 1\)"):
        init_megatron_parallel(2, 1, 1)
    assert megatron_available() is None


def test_built_model_has_the_converter_key_names(megatron_world, checkpoints):
    _, config, hf = checkpoints["qwen3"]
    model = mm.build_gpt_model(config, mm.transformer_config_from_hf(config))
    names = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    assert names == set(mm.hf_to_megatron(hf.state_dict(), config))
    assert "decoder.layers.1.self_attention.q_layernorm.weight" in names
    assert "output_layer.weight" not in names  # tied, one stage: the head reads the embedding


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_transformers(megatron_world, checkpoints, name):
    _, _, hf = checkpoints[name]
    model = _megatron(name, checkpoints)
    out = _forward(model, IDS)  # [b, s, padded V]
    with torch.no_grad():
        ref = hf(IDS).logits  # [b, s, V]
    assert out.shape == (2, IDS.shape[1], mm.padded_vocab_size(VOCAB, 1))
    assert ref.abs().max() > 1.0  # logits are large enough for a wrong mapping to show
    torch.testing.assert_close(out[..., :VOCAB], ref, rtol=1e-4, atol=1e-4)
    assert not out[..., VOCAB:].any()  # padded rows are zero: logits 0, to be masked by the trainer


@pytest.mark.parametrize("name", ["qwen3", "llama_tied"])
def test_packed_row_matches_samples_alone(megatron_world, checkpoints, name):
    model = _megatron(name, checkpoints)
    a, b = IDS[0, :5], IDS[1, :7]
    row = torch.cat([a, b])[None]  # positions 0..11 continue: RoPE is relative, the mask separates
    packed = _forward(model, row, mm.packed_attention_mask([5, 7]))
    alone_a, alone_b = _forward(model, a[None]), _forward(model, b[None])
    torch.testing.assert_close(packed[0, :5], alone_a[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed[0, 5:], alone_b[0], rtol=1e-4, atol=1e-4)
    # the mask matters: without it the second sample sees the first ...
    assert not torch.allclose(_forward(model, row)[0, 5:], alone_b[0], atol=1e-3)
    # ... and a passed mask replaces megatron's causal one, so a block mask without causality is wrong
    block_only = mm.packed_attention_mask([5, 7]) & mm.packed_attention_mask([12])
    assert not torch.allclose(_forward(model, row, block_only)[0, 5:], alone_b[0], atol=1e-3)


@pytest.mark.parametrize("name", ["llama_tied", "qwen3", "qwen2"])
def test_iter_hf_weights_world1_round_trips_into_transformers(megatron_world, checkpoints, name):
    import transformers

    _, config, hf = checkpoints[name]
    model = _megatron(name, checkpoints)
    streamed = [(k, v.clone()) for k, v in mm.iter_hf_weights(model, config)]
    names = [k for k, _ in streamed]
    assert len(names) == len(set(names)) and names[0] == "model.embed_tokens.weight"
    weights = dict(streamed)
    merged = mm.megatron_to_hf([model.state_dict()], config)
    assert set(weights) == set(merged) and all(torch.equal(weights[k], merged[k]) for k in merged)
    fresh = getattr(transformers, MODELS[name][1])(config).eval()
    result = fresh.load_state_dict(weights, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    fresh.tie_weights()
    for k, v in hf.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_schedule_backward_matches_transformers_gradients(megatron_world, checkpoints):
    """megatron's forward-backward schedule runs on CPU under cpu_schedule; grads equal HF's."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from agentrl.trainer.megatron_compat import cpu_schedule

    _, config, hf = checkpoints["qwen3"]
    model = _megatron("qwen3", checkpoints)
    ids = IDS[:1]

    def forward_step(batches, model):
        x = next(batches)
        logits = model(x, torch.arange(x.shape[1])[None], None)  # [1, s, V_padded]

        def loss_func(out):
            loss = torch.nn.functional.cross_entropy(out[0, :-1, :VOCAB], x[0, 1:])
            return loss, {"loss": loss.detach()}

        return logits, loss_func

    with cpu_schedule():
        (metrics,) = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([ids]),
            model=[model],
            num_microbatches=1,
            seq_length=ids.shape[1],
            micro_batch_size=1,
        )
    hf.zero_grad()
    hf(ids, labels=ids).loss.backward()
    grads = mm.megatron_to_hf([{k: p.grad for k, p in model.named_parameters()}], config)
    assert len(grads) == len([k for k, _ in hf.named_parameters()])
    for k, p in hf.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-5)
    hf.zero_grad()
    assert metrics["loss"] > 0


def test_load_is_strict(megatron_world, checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path, config, _ = checkpoints["llama_mha"]
    state = load_file(path / "model.safetensors")
    model = mm.build_gpt_model(config, mm.transformer_config_from_hf(config))
    extra = {**state, "model.layers.1.self_attn.o_proj.bias": torch.zeros(64)}
    save_file(extra, tmp_path / "extra.safetensors")
    with pytest.raises(ValueError, match="o_proj.bias"):
        mm.load_hf_checkpoint(model, tmp_path / "extra.safetensors", config)
    missing = {k: v for k, v in state.items() if k != "model.layers.0.mlp.up_proj.weight"}
    save_file(missing, tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="up_proj"):
        mm.load_hf_checkpoint(model, tmp_path / "missing.safetensors", config)


# -- configuration -------------------------------------------------------------------------------


def test_config_mapping_and_overrides(checkpoints):
    _, config, _ = checkpoints["qwen3"]
    tc = mm.transformer_config_from_hf(
        config, overrides={"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    )
    assert (tc.num_query_groups, tc.kv_channels, tc.ffn_hidden_size) == (2, 24, 96)
    assert tc.qk_layernorm and not tc.add_qkv_bias and tc.hidden_dropout == 0 and tc.attention_dropout == 0
    assert tc.recompute_granularity == "full"
    assert mm.transformer_config_from_hf(checkpoints["qwen2"][1]).add_qkv_bias
    assert {"recompute_granularity", "tensor_model_parallel_size"} <= mm.megatron_field_names()
    assert mm.padded_vocab_size(300, 1) == 384 and mm.padded_vocab_size(300, 2) == 512
    assert mm.padded_vocab_size(256, 2) == 256


def test_unsupported_models_and_unknown_overrides_are_refused(checkpoints):
    from transformers import GPT2Config, LlamaConfig, MistralConfig

    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported.*llama, mistral, qwen2, qwen3"):
        mm.transformer_config_from_hf(GPT2Config())
    scaled = LlamaConfig(
        **COMMON,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "rope_theta": 1e4,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    with pytest.raises(ValueError, match="rope scaling 'llama3'"):
        mm.transformer_config_from_hf(scaled)
    with pytest.raises(ValueError, match="sliding window"):
        mm.transformer_config_from_hf(MistralConfig(**{**COMMON, "sliding_window": 16}))
    with pytest.raises(ValueError, match="attention_bias"):
        mm.transformer_config_from_hf(LlamaConfig(**COMMON, attention_bias=True))
    config = checkpoints["llama_tied"][1]
    with pytest.raises(ValueError, match="'recompute_granularty'.*recompute_granularity"):
        mm.transformer_config_from_hf(config, overrides={"recompute_granularty": "full"})
    with pytest.raises(ValueError, match="masked_softmax_fusion"):
        mm.transformer_config_from_hf(config, overrides={"masked_softmax_fusion": True})


# -- tensor and pipeline parallelism over gloo ---------------------------------------------------


def _parallel_worker(rank: int, port: int, root: str) -> None:
    """One of 2 gloo ranks: TP=2 forward + weight gather, then PP=2 weight gather."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for tp, pp in ((2, 1), (1, 2)):
        init_megatron_parallel(tp, pp)
        for name in ("qwen3", "llama_tied", "qwen2"):
            config = AutoConfig.from_pretrained(Path(root) / name)
            model = mm.build_gpt_model(config, mm.transformer_config_from_hf(config, tp=tp, pp=pp)).eval()
            mm.load_hf_checkpoint(
                model,
                Path(root) / name,
                config,
                tp_rank=ps.get_tensor_model_parallel_rank(),
                tp_size=tp,
                pp_rank=ps.get_pipeline_model_parallel_rank(),
                pp_size=pp,
            )
            results[(name, tp, pp, "weights")] = {k: v.clone() for k, v in mm.iter_hf_weights(model, config)}
            if pp == 1:
                logits = _forward(model, IDS).contiguous()  # [b, s, V_padded / tp]: this rank's vocab slice
                parts = [torch.empty_like(logits) for _ in range(tp)]
                dist.all_gather(parts, logits, group=ps.get_tensor_model_parallel_group())
                results[(name, tp, pp, "logits")] = torch.cat(parts, dim=-1)
        destroy_megatron_parallel()
    torch.save(results, Path(root) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.e2e
def test_tp2_and_pp2_over_gloo(megatron_world, checkpoints):
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    root = next(iter(checkpoints.values()))[0].parent
    mp.spawn(_parallel_worker, args=(_free_port(), str(root)), nprocs=2, join=True)
    ranks = [torch.load(root / f"rank{r}.pt") for r in range(2)]
    for name in ("qwen3", "llama_tied", "qwen2"):
        path, config, _ = checkpoints[name]
        original = load_file(path / "model.safetensors")
        if config.tie_word_embeddings:
            original.pop("lm_head.weight", None)
        tp1 = _forward(_megatron(name, checkpoints), IDS)[..., :VOCAB]
        for results in ranks:
            for tp, pp in ((2, 1), (1, 2)):
                weights = results[(name, tp, pp, "weights")]
                assert set(weights) == set(original), (name, tp, pp)
                for k, v in original.items():
                    assert torch.equal(weights[k], v), (name, tp, pp, k)
            tp2 = results[(name, 2, 1, "logits")]
            assert tp2.shape[-1] == mm.padded_vocab_size(VOCAB, 2)
            torch.testing.assert_close(tp2[..., :VOCAB], tp1, rtol=1e-4, atol=1e-4)


def _theta(cfg) -> float:
    """RoPE base as config.json holds it (newer transformers keep it in rope_parameters)."""
    return (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or getattr(cfg, "rope_theta", 10000.0)


def slime_model_args(cfg) -> list[str]:
    """``MODEL_ARGS`` as slime's ``scripts/models/qwen*.sh`` write them, for an HF config."""
    args = ["--swiglu", "--num-layers", str(cfg.num_hidden_layers), "--hidden-size", str(cfg.hidden_size)]
    args += ["--ffn-hidden-size", str(cfg.intermediate_size), "--num-attention-heads", str(cfg.num_attention_heads)]
    args += ["--group-query-attention", "--num-query-groups", str(cfg.num_key_value_heads)]
    args += ["--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm"]
    args += ["--norm-epsilon", repr(cfg.rms_norm_eps), "--rotary-base", str(int(_theta(cfg)))]
    args += ["--vocab-size", str(cfg.vocab_size), "--kv-channels", str(getattr(cfg, "head_dim", None) or 16)]
    if cfg.model_type == "qwen2":
        args.append("--add-qkv-bias")
    if cfg.model_type == "qwen3":
        args.append("--qk-layernorm")
    if not cfg.tie_word_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    return args


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama_tied"])
def test_slime_model_args_are_accepted_when_they_agree_and_refused_naming_both_values(checkpoints, name):
    from agentrl.flags import parse_passthrough_flags

    hf = checkpoints[name][1]
    args = parse_passthrough_flags(slime_model_args(hf))["megatron_args"]
    built = mm.transformer_config_from_hf(hf, overrides=args)  # pasted MODEL_ARGS: accepted, nothing overridden
    assert built.num_layers == hf.num_hidden_layers and built.num_query_groups == hf.num_key_value_heads
    with pytest.raises(
        ValueError, match=r"--rotary-base 500000 disagrees with the checkpoint's config.json, which gives"
    ):
        mm.transformer_config_from_hf(hf, overrides={**args, "rotary_base": 500000})
    with pytest.raises(ValueError, match=r"--num-layers 3 disagrees .* gives 2"):
        mm.transformer_config_from_hf(hf, overrides={**args, "num_layers": 3})
    flipped = "--untie-embeddings-and-output-weights" if hf.tie_word_embeddings else "--qk-layernorm"
    wrong = parse_passthrough_flags(slime_model_args(hf) + [flipped])["megatron_args"]
    with pytest.raises(ValueError, match=f"{flipped} disagrees"):
        mm.transformer_config_from_hf(hf, overrides=wrong)


def test_model_flags_from_a_config_file_compare_as_numbers(checkpoints):
    hf = checkpoints["qwen3"][1]
    mm.check_model_flags(hf, {"norm_epsilon": "1e-6", "normalization": "RMSNorm"})  # YAML reads 1e-6 as text
    with pytest.raises(ValueError, match="--num-layers disagrees"):  # a flag with no value is True, not 1
        mm.check_model_flags(hf, {"num_layers": True})
