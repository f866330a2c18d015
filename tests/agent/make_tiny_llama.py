"""Build a tiny Llama checkpoint (random weights, locally trained BPE tokenizer) for real-engine tests.

Runs under the vLLM test virtualenv (it has torch, transformers and tokenizers): no downloads.
Usage: python make_tiny_llama.py OUTPUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 1024


def corpus() -> list[str]:
    words = [
        "the",
        "cache",
        "holds",
        "keys",
        "and",
        "values",
        "for",
        "every",
        "token",
        "so",
        "decoding",
        "does",
        "not",
        "recompute",
        "the",
        "prefix",
    ]
    lines = []
    for i in range(2000):
        lines.append(" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) + f" {i}")
    return lines


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(out)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
