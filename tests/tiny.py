"""Tiny offline test models: a byte-level BPE trained on Moby-Dick and a random Llama using it."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tests.text import moby_dick

EOS = "<|endoftext|>"
# Seen in training a few times, so some multi-byte characters merge into one token and others
# stay split over two or three byte-level tokens.
EXTRA_TEXT = (
    "Café naïve façade résumé Zürich 東京は日本の首都です。北京欢迎你 😀🎉👍🏽 🐋 — “q” ½ ñ\n"
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@functools.cache
def byte_bpe_tokenizer(vocab_size: int = 1000) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) trained offline on chapters 1-3 of Moby-Dick."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([moby_dick(1, 3), EXTRA_TEXT * 3], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=EOS, clean_up_tokenization_spaces=False
    )


def save_tiny_llama(folder: Path, seed: int = 0, num_layers: int = 2) -> Path:
    """A random Llama (hidden 64, 4 heads / 2 KV heads) with the BPE tokenizer, fp32."""
    tokenizer = byte_bpe_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger logits, so sampling is not flat and greedy has clear winners
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder
