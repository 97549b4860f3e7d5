"""Model architectures, keyed by HF `model_type`."""

from torch import nn

from zcode.models.gemma3 import Gemma3ForCausalLM
from zcode.models.glm4 import Glm4ForCausalLM
from zcode.models.glm4_moe import Glm4MoeForCausalLM
from zcode.models.glm_moe_dsa import GlmMoeDsaForCausalLM
from zcode.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "glm4": Glm4ForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "glm_moe_dsa": GlmMoeDsaForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}


def model_class(model_type: str) -> type[nn.Module]:
    if model_type not in MODEL_REGISTRY:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {supported}")
    return MODEL_REGISTRY[model_type]
