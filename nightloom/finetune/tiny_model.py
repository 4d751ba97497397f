"""Build a tiny random Llama and a byte-level BPE tokenizer (vocab ~300): the demo's and the tests' base model.

Run by the XTuner env's interpreter (never imports nightloom): `python tiny_model.py OUT_DIR`. Deterministic
(seeded); ~0.5 MB; written to a temp folder and renamed, so a half-built model is never picked up.
"""

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = [
    "the",
    "a",
    "model",
    "data",
    "train",
    "tune",
    "token",
    "layer",
    "sum",
    "add",
    "list",
    "name",
    "city",
    "color",
    "number",
    "small",
    "large",
    "fast",
    "slow",
    "what",
    "is",
    "how",
    "do",
    "you",
    "write",
    "give",
    "answer",
    "question",
    "explain",
    "why",
    "when",
]


def corpus() -> list[str]:
    lines = []
    for i in range(200):
        w = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(8)]
        lines.append(" ".join(w) + f" {i % 10}")
    return lines + ["### Human: ", "### Assistant: ", "\n"]


def main(final: Path) -> None:
    import os
    import shutil

    out = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    if final.exists():
        shutil.rmtree(final)
    os.replace(out, final)
    print(f"assets: {final} vocab={len(fast)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
