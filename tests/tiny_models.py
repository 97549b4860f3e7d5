"""Tiny random checkpoints built from transformers' own config classes, saved with save_pretrained.

transformers is the oracle: the same saved directory is loaded by transformers (eager attention,
fp32) and by our loader.
"""

import inspect
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    Glm4Config,
    Glm4MoeConfig,
    GlmMoeDsaConfig,
    LlamaConfig,
)

TRANSFORMERS_VERSION = "5.23.0"
VOCAB = 256
GEMMA3_WINDOW = 4

MOE = dict(
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
)


def configs() -> dict[str, object]:
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    # index_topk 8 < the test sequences, so the indexer really drops tokens; 16 indexer heads make
    # exact score ties (which make the oracle itself ambiguous) practically vanish.
    dsa = dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_group=2,
        topk_group=1,
        index_topk=8,
        index_n_heads=16,
        index_head_dim=16,
        rope_parameters=rope,
    )
    return {
        "llama": LlamaConfig(
            **common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        ),
        "glm4": Glm4Config(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            rms_norm_eps=1e-5,
        ),
        "glm4_moe": Glm4MoeConfig(
            **common,
            **MOE,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            n_group=2,
            topk_group=1,
            use_qk_norm=False,
            rope_parameters=rope,
        ),
        "glm4_moe_qknorm": Glm4MoeConfig(
            **common,
            **MOE,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            n_group=2,
            topk_group=1,
            use_qk_norm=True,
            rope_parameters=rope,
        ),
        "glm_moe_dsa": GlmMoeDsaConfig(**common, **MOE, **dsa, num_hidden_layers=3),
        # sliding_window 4 < the test sequences, so sliding layers really drop old keys;
        # query_pre_attn_scalar != head_dim, and linear RoPE scaling on the full layers only.
        "gemma3_text": Gemma3TextConfig(
            **common,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=GEMMA3_WINDOW,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        ),
        # GLM-5.2 IndexShare: layers alternate between running the indexer and sharing its top-k.
        "glm_moe_dsa_shared": GlmMoeDsaConfig(
            **common, **MOE, **dsa, num_hidden_layers=4, index_topk_freq=2
        ),
    }


def check_oracle_version() -> None:
    assert transformers.__version__ == TRANSFORMERS_VERSION, (
        f"parity oracle pinned to transformers {TRANSFORMERS_VERSION}, "
        f"found {transformers.__version__}"
    )
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as dsa

    # Older releases used half-split RoPE and no ReLU in the indexer (see glm-architecture.md).
    source = inspect.getsource(dsa.GlmMoeDsaIndexer.forward)
    assert "apply_rotary_pos_emb_interleave" in source and "F.relu" in source


def mtp_configs() -> dict[str, object]:
    """GLM configs whose checkpoints carry one MTP layer (kept apart from `configs()`, whose
    names the parity tests run)."""
    return {
        f"{name}_mtp": _with(configs()[name], num_nextn_predict_layers=1)
        for name in ("glm4_moe", "glm_moe_dsa")
    }


def _with(config, **fields):
    """A copy of `config` with `fields` changed; per-layer type lists are derived again."""
    values = {
        k: v for k, v in config.to_dict().items() if k not in ("layer_types", "indexer_types")
    }
    values.pop("mlp_layer_types", None)
    return type(config)(**(values | fields))


def make_checkpoint(name: str, out_dir: Path, seed: int = 0):
    """Saves a random model of the named config; returns the transformers model (the oracle)."""
    torch.manual_seed(seed)
    config = (configs() | mtp_configs())[name]
    model = _random_model(config)
    model.save_pretrained(out_dir)
    if name in mtp_configs():
        _add_mtp_layer(config, out_dir)
    return model


def _random_model(config):
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for module_name, buf in model.named_buffers():
            if module_name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand_like(buf) * 0.1)  # exercise the bias path (init is zeros)
        for module_name, param in model.named_parameters():
            if "layernorm" in module_name or "norm" in module_name.split(".")[-2]:
                param.add_(torch.randn_like(param) * 0.1)  # norms are ones at init
    return model.eval()


def _add_mtp_layer(config, out_dir: Path) -> None:
    """Writes an MTP layer into the saved checkpoint (transformers' models have none): the
    decoder layer a model one layer deeper would have there, as save_pretrained names it, and
    the MTP tensors of GLM checkpoints. enorm and hnorm differ well, so that swapping them shows."""
    num_layers, hidden_size = config.num_hidden_layers, config.hidden_size
    deeper = _random_model(_with(config, num_hidden_layers=num_layers + 1))
    prefix = f"model.layers.{num_layers}."
    with tempfile.TemporaryDirectory() as tmp:
        deeper.save_pretrained(tmp)
        layer = {k: v for k, v in load_file(f"{tmp}/model.safetensors").items() if prefix in k}
    layer |= {
        f"{prefix}enorm.weight": 1 + torch.randn(hidden_size) * 0.5,
        f"{prefix}hnorm.weight": 1 + torch.randn(hidden_size) * 0.5,
        f"{prefix}eh_proj.weight": torch.randn(hidden_size, 2 * hidden_size) * 0.05,
        f"{prefix}shared_head.norm.weight": 1 + torch.randn(hidden_size) * 0.1,
    }
    path = out_dir / "model.safetensors"
    save_file(load_file(path) | layer, path, metadata={"format": "pt"})
