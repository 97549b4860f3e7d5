"""GGUF metadata -> HF config, by our own table per architecture (llama.cpp's key names, as its
converters write them; not transformers' GGUF tables, which lack glm4moe and glm-dsa).

Architectures (`general.architecture` -> HF `model_type`): llama -> llama, glm4 -> glm4,
glm4moe -> glm4_moe, glm-dsa -> glm_moe_dsa, gemma3 -> gemma3_text.
"""

from zcode.errors import CheckpointError

MODEL_TYPES = {
    "llama": "llama",
    "glm4": "glm4",
    "glm4moe": "glm4_moe",
    "glm-dsa": "glm_moe_dsa",
    "gemma3": "gemma3_text",
}

# HF field <- '{arch}.' key, for every architecture that has it.
_COMMON = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "max_position_embeddings": "context_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "head_dim": "attention.key_length",
}
_MOE = {
    "n_routed_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "n_group": "expert_group_count",
    "topk_group": "expert_group_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "n_shared_experts": "expert_shared_count",
    "first_k_dense_replace": "leading_dense_block_count",
    "routed_scaling_factor": "expert_weights_scale",
    "norm_topk_prob": "expert_weights_norm",
}
_DSA = {
    "q_lora_rank": "attention.q_lora_rank",
    "kv_lora_rank": "attention.kv_lora_rank",
    "v_head_dim": "attention.value_length_mla",
    "index_n_heads": "attention.indexer.head_count",
    "index_head_dim": "attention.indexer.key_length",
    "index_topk": "attention.indexer.top_k",
}
_TOKENS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
    "unk_token_id": "tokenizer.ggml.unknown_token_id",
}


def supported() -> str:
    return ", ".join(MODEL_TYPES)


def gguf_config_dict(path, metadata: dict, tensor_names: set[str]) -> dict:
    """HF config fields (with 'model_type') for a GGUF file's metadata and tensor names."""
    arch = metadata.get("general.architecture")
    if arch not in MODEL_TYPES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {supported()}"
        )

    def get(key: str, default=None):
        return metadata.get(f"{arch}.{key}", default)

    try:
        config = _fields(metadata, arch, _COMMON, _TOKENS)
        num_layers = get("block_count")
        if num_layers is None:
            raise KeyError(f"{arch}.block_count")
        num_nextn = get("nextn_predict_layers", 0)
        config["num_hidden_layers"] = num_layers - num_nextn
        config["vocab_size"] = get("vocab_size") or metadata["tokenizer.ggml.tokens"]
        # llama.cpp writes the output projection only when it is not the embedding matrix
        config["tie_word_embeddings"] = "output.weight" not in tensor_names
        rope_theta = float(get("rope.freq_base", 10000.0))
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rope_dim = get("rope.dimension_count")
        if arch in ("glm4", "glm4moe"):
            config["partial_rotary_factor"] = rope_dim / head_dim
            config["rope_parameters"]["partial_rotary_factor"] = rope_dim / head_dim
        if arch == "glm4":
            config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        if arch in ("glm4moe", "glm-dsa"):
            config.update(_fields(metadata, arch, _MOE))
            config["num_nextn_predict_layers"] = num_nextn
        if arch == "glm4moe":
            config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensor_names
            config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        if arch == "glm-dsa":
            config.update(_dsa_fields(metadata, arch, config, rope_dim))
        if arch == "gemma3":
            config.update(_gemma3_fields(metadata, arch, config, num_layers))
    except KeyError as e:
        raise CheckpointError(f"{path}: GGUF metadata lacks {e} ({arch})") from e
    config["model_type"] = MODEL_TYPES[arch]
    return config


def _fields(metadata: dict, arch: str, table: dict, tokens: dict | None = None) -> dict:
    out = {
        hf: metadata[f"{arch}.{key}"] for hf, key in table.items() if f"{arch}.{key}" in metadata
    }
    for hf, key in (tokens or {}).items():
        if key in metadata:
            out[hf] = metadata[key]
    return out


def _dsa_fields(metadata: dict, arch: str, config: dict, rope_dim: int) -> dict:
    out = _fields(metadata, arch, _DSA)
    # llama.cpp runs MLA as MQA over the latent: key_length = kv_lora_rank + rope dims
    qk_rope = metadata[f"{arch}.attention.key_length"] - out["kv_lora_rank"]
    out["qk_rope_head_dim"] = qk_rope
    out["qk_nope_head_dim"] = metadata[f"{arch}.attention.key_length_mla"] - qk_rope
    out["head_dim"] = qk_rope
    out["num_key_value_heads"] = config["num_attention_heads"]  # file says 1: the latent
    config["rope_parameters"]["partial_rotary_factor"] = rope_dim / qk_rope
    types = metadata.get(f"{arch}.attention.indexer.types")
    if types is not None:
        out["indexer_types"] = ["full" if t else "shared" for t in types]
    return out


def _gemma3_fields(metadata: dict, arch: str, config: dict, num_layers: int) -> dict:
    head_dim = metadata[f"{arch}.attention.key_length"]
    window = metadata.get(f"{arch}.attention.sliding_window")
    pattern = 6  # llama.cpp's gemma3: every 6th layer attends globally
    out = {
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": window,
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ],
        "rope_parameters": {
            "full_attention": {
                "rope_type": "default",
                "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 1e6)),
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "tie_word_embeddings": True,
    }
    scaling = metadata.get(f"{arch}.rope.scaling.factor")
    if scaling and metadata.get(f"{arch}.rope.scaling.type") == "linear":
        out["rope_parameters"]["full_attention"].update(rope_type="linear", factor=scaling)
    softcap = metadata.get(f"{arch}.final_logit_softcapping")
    if softcap is not None:
        out["final_logit_softcapping"] = softcap
    return out
