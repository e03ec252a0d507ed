"""Tiny random-weight models that vLLM's CPU backend runs, saved as a model folder.

No weights can be downloaded: each family is a ``transformers`` config with random
float32 weights (``save_pretrained``); engines load it with ``skip_tokenizer_init=True``
and token-id prompts. Float32, because random bf16 models tie their logits, and greedy
tokens then say nothing about the KV they were computed from.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    family: str
    path: str
    seed: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=2048,
                       tie_word_embeddings=False, initializer_range=0.1)


def _gemma3_config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=2048,
                            sliding_window=64, initializer_range=0.1, tie_word_embeddings=False,
                            layer_types=["sliding_attention"] * 3 + ["full_attention"],
                            architectures=["Gemma3ForCausalLM"])


def _gemma2_config():
    from transformers import Gemma2Config

    # tied embeddings (Gemma 2's default): vLLM's Gemma2ForCausalLM has no lm_head to load
    return Gemma2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=2048,
                        sliding_window=64, query_pre_attn_scalar=64, initializer_range=0.1)


def _qwen3_next_config():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=2048,
                           linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                           linear_num_key_heads=1, linear_num_value_heads=2, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=128, shared_expert_intermediate_size=128,
                           mlp_only_layers=[0, 1, 2], initializer_range=0.1, tie_word_embeddings=False,
                           layer_types=["linear_attention"] * 3 + ["full_attention"])


FAMILIES = {"llama": _llama_config, "gemma2": _gemma2_config, "gemma3": _gemma3_config,
            "qwen3_next": _qwen3_next_config}


def build_model(family: str, path: str, seed: int = 0, num_layers: Optional[int] = None,
                num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None) -> ModelSpec:
    """Save ``family``'s tiny model with weights drawn from ``seed`` into ``path``.

    For the dense llama only, its shape: ``num_layers`` (2 by default), ``num_kv_heads``
    (2) and ``head_dim`` (64), which set its KV bytes per token (:func:`kv_bytes_per_token`);
    the query heads are the KV heads times 2, at least 4 (GQA), the hidden size stays 256."""
    import torch
    from transformers import AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {sorted(FAMILIES)}")
    config = FAMILIES[family]()
    shape = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    given = [k for k, v in shape.items() if v is not None]
    if given and family != "llama":
        raise ValueError(f"{', '.join(given)}: for the dense llama only ({family} has per-layer types)")
    for k, v in shape.items():
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{k} must be a positive int, got {v!r}")
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    if num_kv_heads is not None:
        config.num_key_value_heads = num_kv_heads
        config.num_attention_heads = max(4, 2 * num_kv_heads)
    if head_dim is not None:
        config.head_dim = head_dim
    config.torch_dtype = torch.float32
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    config.save_pretrained(path)
    return ModelSpec(family, path, seed, config.vocab_size, config.num_hidden_layers,
                     config.num_key_value_heads, config.head_dim)


def read_spec(path: str, seed: int = 0) -> ModelSpec:
    """The :class:`ModelSpec` of a dense model :func:`build_model` saved at ``path``."""
    import json

    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    return ModelSpec(c["model_type"], path, seed, c["vocab_size"], c["num_hidden_layers"], c["num_key_value_heads"],
                     c["head_dim"])


def kv_bytes_per_token(spec: ModelSpec) -> int:
    """KV bytes one token takes in a dense model's cache over all its layers (K and V,
    float32): what a P/D transfer moves per prompt token, pages' padding aside."""
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4
