"""The byte tokenizer (`model.tokenizer: bytes`, nightloom.tokenizer.BytesTokenizer) in Hugging Face form: a
`tokenizer.json` that `tokenizers` and transformers' `AutoTokenizer` load and that encodes every string to its UTF-8
bytes, exactly as the run's own tokenizer did, so a bytes run's export is a whole Hugging Face model (lm-eval's HF
backend, `from_pretrained`).

How: a BPE model with no merges over the 256 byte symbols of GPT-2's byte-to-unicode alphabet, behind a ByteLevel
normalizer (each UTF-8 byte becomes its symbol) and decoder. The EOS id 0 is the NUL byte: it is an added special
token whose text is NUL itself, not the symbol `Ā` (U+0100) that the alphabet gives byte 0, so a text holding `Ā`
still encodes as its two UTF-8 bytes. Nothing is prepended or appended (no post-processor), as BytesTokenizer.encode.
"""

from __future__ import annotations

import json
from pathlib import Path

from nightloom.tokenizer import BYTES_EOS
from nightloom.util import atomic_write_text

FILES = ("tokenizer.json", "tokenizer_config.json")
EOS_TEXT = chr(BYTES_EOS)


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of `tokenizers`' ByteLevel pieces; Radford et al.
    2019, openai/gpt-2 encoder.py `bytes_to_unicode`): printable Latin-1 bytes map to themselves, the other 68 to
    U+0100 onwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer():
    """The `tokenizers.Tokenizer` whose ids are a string's UTF-8 bytes (id = byte value), EOS the NUL byte."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {sym: b for b, sym in byte_symbols().items()}
    vocab.pop(byte_symbols()[BYTES_EOS])
    vocab[EOS_TEXT] = BYTES_EOS  # matched as an added token on the raw text, before the normalizer
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.normalizer = normalizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TEXT, special=True, normalized=False)])
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json: the EOS, no BOS, and no clean-up of spaces on decode (which would change text)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TEXT,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }


def write_byte_tokenizer(folder: str | Path) -> list[Path]:
    """tokenizer.json and tokenizer_config.json of the byte tokenizer in `folder` (each written then renamed);
    the paths written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / FILES[0], byte_tokenizer().to_str(pretty=True) + "\n")
    atomic_write_text(folder / FILES[1], json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n")
    return [folder / f for f in FILES]
