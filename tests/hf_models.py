"""Tiny ``transformers`` models built from configs with random init (nothing is downloaded).

Shared by ``tests/test_hf_models.py`` (pool workers) and ``tests/hf_runs.py`` (Trainer runs).
Sizes: hidden 16-32, two layers per stack, vocab 128, so a forward+backward takes milliseconds.
Dropout is off and the Switch router's jitter noise is 0, so runs are deterministic.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128

BLOCK_CLASS_NAMES = {"t5": ("T5Block",), "bart": ("BartEncoderLayer", "BartDecoderLayer"),
                     "switch": ("SwitchTransformersBlock",)}
"""The class names of one transformer block (of either stack) per encoder-decoder kind."""


def make_seq2seq(kind: str) -> nn.Module:
    """A 2+2-layer encoder-decoder: ``"t5"`` (T5ForConditionalGeneration), ``"bart"``, ``"switch"``."""
    if kind == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                          num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
                          pad_token_id=0)
        return T5ForConditionalGeneration(config)
    if kind == "bart":
        from transformers import BartConfig, BartForConditionalGeneration

        config = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                            decoder_ffn_dim=64, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                            activation_dropout=0.0)
        return BartForConditionalGeneration(config)
    if kind == "switch":
        from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

        # Every layer sparse, 8 separate expert modules (top-1 routing), no capacity drops, no jitter.
        config = SwitchTransformersConfig(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                          num_decoder_layers=2, num_heads=4, num_experts=8, expert_capacity=64,
                                          encoder_sparse_step=1, decoder_sparse_step=1, router_jitter_noise=0.0,
                                          relative_attention_num_buckets=8, dropout_rate=0.0,
                                          decoder_start_token_id=0, pad_token_id=0)
        return SwitchTransformersForConditionalGeneration(config)
    raise ValueError(f"unknown seq2seq kind {kind!r}")


def make_llama(seed: int = 0, layers: int = 2) -> nn.Module:
    """LlamaForCausalLM: hidden 32, ``layers`` layers, 4 heads (2 KV heads), untied head, vocab 128."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.1)
    return LlamaForCausalLM(config)


def make_qwen3_moe(seed: int = 0) -> nn.Module:
    """Qwen3MoeForCausalLM: 16 experts fused in 3-D tensors, top-2 routing, 2 layers, vocab 128."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=16, num_experts_per_tok=2, max_position_embeddings=64, initializer_range=0.1)
    return Qwen3MoeForCausalLM(config)


def make_deberta_mlm(seed: int = 0) -> nn.Module:
    """DebertaV2ForMaskedLM (``legacy=False``): its head reads the word embedding's ``.weight`` itself, no tie."""
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    torch.manual_seed(seed)
    config = DebertaV2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=32, type_vocab_size=0, legacy=False,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return DebertaV2ForMaskedLM(config)


def make_tokens(steps: int, batch: int, seq: int = 8, seed: int = 1) -> torch.Tensor:
    """``steps`` global batches of random tokens: shape (steps, batch, seq)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, batch, seq), generator=generator)
