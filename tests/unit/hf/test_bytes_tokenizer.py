"""nightloom.hf.bytes_tokenizer: the byte tokenizer's Hugging Face form encodes every string as the run's
BytesTokenizer does (id = UTF-8 byte, nothing added), through `tokenizers`, transformers' AutoTokenizer and
nightloom's own HF tokenizer reader, and decodes back to the text."""

from __future__ import annotations

import random

import pytest

from nightloom.hf.bytes_tokenizer import EOS_TEXT, byte_symbols, write_byte_tokenizer
from nightloom.spec import TokenizerSpec
from nightloom.tokenizer import BYTES_EOS, BytesTokenizer, HFTokenizer

FIXED = [
    "",
    "orjp: 3+3=",
    "héllo wörld ☃ 𝄞 日本語",
    "\x00a\x00",  # the EOS byte inside a text
    "Ā",  # the alphabet's symbol for byte 0, as text: its own two bytes
    "ĀĀ\x00Ā Ġhello",  # symbols of the ByteLevel alphabet are text like any other
    " a  b\n\tc\r\n",
    "<|endoftext|> <s> </s> [PAD]",
    "don't . , ' s",  # no clean-up of spaces on decode
    "\x7f\x01\x1f\u200b\ufeff",
]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    """Seeded strings over ASCII, Latin-1, control characters, the ByteLevel alphabet and astral code points."""
    rng = random.Random(seed)
    pools = [
        [chr(c) for c in range(0, 128)],
        [chr(c) for c in range(128, 0x250)],
        list(byte_symbols().values()),
        [chr(rng.randrange(0x800, 0xD800)) for _ in range(200)],
        [chr(rng.randrange(0x10000, 0x10FFFF)) for _ in range(50)],
    ]
    return ["".join(rng.choice(rng.choice(pools)) for _ in range(rng.randrange(0, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("bytes-tok")
    write_byte_tokenizer(out)
    return out


def test_symbols_are_a_bijection():
    table = byte_symbols()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert table[ord("a")] == "a" and table[0] == "Ā" and table[ord(" ")] == "Ġ"


def test_ids_equal_bytes_tokenizer(folder):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    texts = FIXED + _random_texts(500)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(folder))
    ours = HFTokenizer(folder, TokenizerSpec(path=str(folder)))
    want = BytesTokenizer().encode_batch(texts)
    assert [e.ids for e in raw.encode_batch(texts)] == want
    assert auto(texts)["input_ids"] == want
    assert ours.encode_batch(texts) == want
    assert (ours.eos_id, auto.eos_token_id, auto.eos_token, auto.bos_token_id) == (BYTES_EOS, 0, EOS_TEXT, None)
    assert ours.vocab_size == len(auto) == 256
    assert [auto.decode(ids) for ids in want] == texts


def test_decode_of_generated_bytes(folder):
    """What a model generates: any byte ids, invalid UTF-8 included, decoded as bytes.decode(errors="replace")."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(folder))
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(1, 256) for _ in range(rng.randrange(1, 12))]
        assert auto.decode(ids) == bytes(ids).decode("utf-8", errors="replace"), ids
    assert auto.decode([51, 0, 52], skip_special_tokens=True) == "34"


def test_written_files_are_stable(tmp_path, folder):
    """Two writes give the same bytes: the base's benchmark cache is keyed by the tokenizer files' digest."""
    again = write_byte_tokenizer(tmp_path / "again")
    assert [p.read_bytes() for p in again] == [(folder / p.name).read_bytes() for p in again]


def test_tokenizer_source_names_bytes():
    """A bytes run exports the byte tokenizer's form; a path is its files; the export writes it (test_hf_export)."""
    from types import SimpleNamespace

    from nightloom.hf.export import tokenizer_source
    from nightloom.spec import ModelSpec

    assert tokenizer_source(SimpleNamespace(model=ModelSpec())) == "bytes"
    assert tokenizer_source(SimpleNamespace(model=ModelSpec(tokenizer="some/tok"))) == "some/tok"
