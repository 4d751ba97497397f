"""One Tokenizer interface over UTF-8 bytes, Hugging Face tokenizer.json, tiktoken rank files and SentencePiece.

A document's ids are exactly what the tokenizer's own rules produce (for a Hugging Face folder: what
`AutoTokenizer.from_pretrained(folder)(text)["input_ids"]` returns, BOS included when its template adds one);
the training stream appends the EOS id after each document (`stream`). The vocabulary size is the tokenizer's
(largest id + 1), and `fingerprint` hashes every file and setting that changes an id, so the sharding settings
hash and a run's checkpoint know which tokenizer made their tokens. Libraries are imported lazily.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from nightloom.spec import TokenizerSpec
from nightloom.util import share_mode

HF_FILES = ("tokenizer.json", "tokenizer_config.json")
BYTES_EOS = 0  # the byte tokenizer's document separator (a NUL byte never occurs in text)


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or lacks what training needs; the message names the file and field."""


class Tokenizer:
    """Ids per document, the EOS id that separates documents in the training stream, and the vocab size."""

    kind: str = ""
    vocab_size: int
    eos_id: int
    bos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        """The document's ids by the tokenizer's own rules (BOS if its template adds one; no EOS appended)."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def count_batch(self, texts: Sequence[str]) -> np.ndarray:
        """Ids per document (as `encode` gives them), int64."""
        return np.fromiter((len(ids) for ids in self.encode_batch(texts)), dtype=np.int64, count=len(texts))

    def encode_ids(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids per document, every document's ids back to back), both int64: `encode_batch` as two arrays (what
        the shard stage writes to token files)."""
        batch = self.encode_batch(texts)
        lengths = np.fromiter(map(len, batch), dtype=np.int64, count=len(batch))
        ids = np.fromiter(itertools.chain.from_iterable(batch), dtype=np.int64, count=int(lengths.sum()))
        return lengths, ids

    def stream(self, texts: Sequence[str]) -> np.ndarray:
        """Every document's ids followed by EOS, concatenated: the packed training stream (int64)."""
        parts = []
        eos = np.array([self.eos_id], dtype=np.int64)
        for ids in self.encode_batch(texts):
            parts += [np.asarray(ids, dtype=np.int64), eos]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def fingerprint(self) -> str:
        raise NotImplementedError


def _sha256_files(kind: str, files: Sequence[Path], settings: dict) -> str:
    h = hashlib.sha256(kind.encode())
    for f in files:  # content only (a copy elsewhere is the same tokenizer); HF file order is fixed
        h.update(hashlib.sha256(f.read_bytes()).digest())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return "sha256:" + h.hexdigest()


class BytesTokenizer(Tokenizer):
    """UTF-8 bytes (vocab 256), separator 0 after every document: the trainer's original stream."""

    kind = "bytes"
    vocab_size = 256
    eos_id = BYTES_EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def count_batch(self, texts: Sequence[str]) -> np.ndarray:
        return np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))

    def encode_ids(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        raw = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter(map(len, raw), dtype=np.int64, count=len(raw))
        return lengths, np.frombuffer(b"".join(raw), dtype=np.uint8).astype(np.int64)

    def stream(self, texts: Sequence[str]) -> np.ndarray:
        sep = bytes([BYTES_EOS])
        return np.frombuffer(b"".join(t.encode("utf-8") + sep for t in texts), dtype=np.uint8).astype(np.int64)

    def fingerprint(self) -> str:
        return "bytes"


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """A folder with tokenizer.json (+ tokenizer_config.json), through the `tokenizers` library.

    BOS/EOS follow transformers 5.24's TokenizersBackend: tokenizer.json's own post-processor decides (its
    template adds BOS or not); `add_bos_token`/`add_eos_token` in tokenizer_config.json are dropped whenever a
    tokenizer.json exists (transformers/tokenization_utils_base.py, `_from_pretrained`), and no post-processor
    means no BOS. tokenizer_config.json gives the BOS/EOS token texts and `split_special_tokens`.
    Model-specific tokenizer classes that rebuild the pipeline in Python are not reproduced."""

    kind = "hf"

    def __init__(self, folder: Path, spec: TokenizerSpec):
        from tokenizers import Tokenizer as RustTokenizer

        self.folder = folder
        tj, tc = folder / "tokenizer.json", folder / "tokenizer_config.json"
        if not tj.is_file():
            raise TokenizerError(f"{folder}: model.tokenizer: no tokenizer.json in this folder")
        try:
            self.tok = RustTokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exception on a bad file
            raise TokenizerError(f"{tj}: cannot be read by `tokenizers`: {e}") from None
        cfg: dict = {}
        if tc.is_file():
            try:
                cfg = json.loads(tc.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{tc}:{e.lineno}: invalid JSON: {e.msg}") from None
        self.files = [tj] + ([tc] if tc.is_file() else [])
        bos = spec.bos or _token_text(cfg.get("bos_token"))
        eos = spec.eos or _token_text(cfg.get("eos_token"))
        self.tok.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
        self.tok.no_truncation()
        self.tok.no_padding()
        if eos is None:
            raise TokenizerError(f"{tc}: eos_token: not set (set model.tokenizer.eos to the EOS token text)")
        eid = self.tok.token_to_id(eos)
        if eid is None:
            raise TokenizerError(f"{tj}: EOS token {eos!r} is not in the vocabulary")
        self.eos_id = eid
        self.bos_id = self.tok.token_to_id(bos) if bos is not None else None
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(list(texts))]

    def fingerprint(self) -> str:
        return _sha256_files(self.kind, self.files, {"eos": self.eos_id})


_PATTERN_LOCK = threading.Lock()


def _named_encoding(name: str) -> dict:
    """(pattern, special tokens) of a tiktoken encoding by name. tiktoken keeps them inside constructors that
    download the ranks, so the constructor runs with its rank loader stubbed out (nothing is fetched)."""
    from tiktoken_ext import openai_public

    ctor = getattr(openai_public, name, None)
    if name.startswith("_") or not callable(ctor) or name not in openai_public.ENCODING_CONSTRUCTORS:
        known = ", ".join(sorted(openai_public.ENCODING_CONSTRUCTORS))
        raise TokenizerError(f"model.tokenizer.pattern: unknown tiktoken encoding {name!r}; known: {known}")
    with _PATTERN_LOCK:
        real = openai_public.load_tiktoken_bpe
        openai_public.load_tiktoken_bpe = lambda *a, **k: {}
        try:
            enc = ctor()
        finally:
            openai_public.load_tiktoken_bpe = real
    return {"pat_str": enc["pat_str"], "special_tokens": dict(enc["special_tokens"])}


class TiktokenTokenizer(Tokenizer):
    """A tiktoken rank file (base64 token, rank per line) + split pattern + special tokens.

    Special tokens written in a document are recognised as specials (`allowed_special="all"`), as Hugging Face
    tokenizers do by default."""

    kind = "tiktoken"

    def __init__(self, path: Path, spec: TokenizerSpec):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        if not spec.pattern:
            raise TokenizerError(
                f"{path}: model.tokenizer.pattern: required for a tiktoken rank file "
                "(a regex, or an encoding name such as cl100k_base)"
            )
        named = _named_encoding(spec.pattern) if "(" not in spec.pattern and "\\" not in spec.pattern else None
        pattern = named["pat_str"] if named else spec.pattern
        specials = dict(spec.special_tokens) or (named["special_tokens"] if named else {})
        try:
            ranks = load_tiktoken_bpe(str(path))
        except Exception as e:  # noqa: BLE001
            raise TokenizerError(f"{path}: not a tiktoken rank file: {e}") from None
        self.path, self.pattern, self.specials = path, pattern, specials
        self.enc = tiktoken.Encoding(path.name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
        eos = spec.eos or ("<|endoftext|>" if "<|endoftext|>" in specials else None)
        if eos is None or eos not in specials:
            raise TokenizerError(f"{path}: model.tokenizer.eos: {eos!r} is not one of the special tokens {specials}")
        self.eos_id = specials[eos]
        if spec.bos is not None and spec.bos not in specials:
            raise TokenizerError(f"{path}: model.tokenizer.bos: {spec.bos!r} is not one of the special tokens")
        self.bos_id = specials[spec.bos] if spec.bos else None
        self.add_bos = spec.add_bos
        if self.add_bos and self.bos_id is None:
            raise TokenizerError(f"{path}: model.tokenizer.add_bos needs model.tokenizer.bos")
        self.vocab_size = self.enc.n_vocab

    def encode(self, text: str) -> list[int]:
        ids = self.enc.encode(text, allowed_special="all")
        return [self.bos_id, *ids] if self.add_bos else ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        out = self.enc.encode_batch(list(texts), allowed_special="all", num_threads=1)
        return [[self.bos_id, *ids] for ids in out] if self.add_bos else out

    def fingerprint(self) -> str:
        settings = {"pattern": self.pattern, "specials": self.specials, "eos": self.eos_id, "bos": self.add_bos}
        return _sha256_files(self.kind, [self.path], settings)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece .model; BOS is added when `model.tokenizer.add_bos` is true (SentencePiece leaves it to
    the caller: Llama 2 and Mistral add it). EOS is the model's own `</s>` unless `eos` names another piece."""

    kind = "sentencepiece"

    def __init__(self, path: Path, spec: TokenizerSpec):
        import sentencepiece as spm

        self.path = path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{path}: not a SentencePiece model: {e}") from None
        eos = self.sp.piece_to_id(spec.eos) if spec.eos else self.sp.eos_id()
        if eos < 0 or (spec.eos and self.sp.id_to_piece(eos) != spec.eos):
            raise TokenizerError(f"{path}: model.tokenizer.eos: the model has no EOS piece {spec.eos or '</s>'!r}")
        self.eos_id = eos
        bos = self.sp.piece_to_id(spec.bos) if spec.bos else self.sp.bos_id()
        self.bos_id = bos if bos >= 0 else None
        self.add_bos = spec.add_bos
        if self.add_bos and self.bos_id is None:
            raise TokenizerError(f"{path}: model.tokenizer.add_bos: the model has no BOS piece")
        self.vocab_size = self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text, add_bos=self.add_bos)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), add_bos=self.add_bos)

    def fingerprint(self) -> str:
        settings = {"eos": self.eos_id, "bos": self.bos_id if self.add_bos else None}
        return _sha256_files(self.kind, [self.path], settings)


def resolve_kind(spec: TokenizerSpec) -> str:
    """`auto`: a folder is Hugging Face, `*.model` SentencePiece, any other file a tiktoken rank file."""
    if spec.kind != "auto":
        return spec.kind
    if spec.path is None:
        return "bytes"
    p = Path(spec.path).expanduser()
    if p.is_dir():
        return "hf"
    return "sentencepiece" if p.suffix == ".model" else "tiktoken"


_CACHE: dict[tuple, Tokenizer] = {}
_CACHE_LOCK = threading.Lock()


def load_tokenizer(spec: TokenizerSpec | str | None) -> Tokenizer:
    """The tokenizer a spec names (`"bytes"`, a path, or a TokenizerSpec); loaded once per process."""
    spec = TokenizerSpec.coerce(spec)
    kind = resolve_kind(spec)
    if kind == "bytes":
        return BytesTokenizer()
    if spec.path is None:
        raise TokenizerError(f"model.tokenizer.path: required for kind {kind!r}")
    path = Path(spec.path).expanduser()
    if not path.exists():
        raise TokenizerError(f"{path}: model.tokenizer.path: not found")
    stat = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in ([path] if path.is_file() else path.iterdir())]
    key = (kind, str(path.resolve()), spec.model_dump_json(), tuple(sorted(stat)))
    with _CACHE_LOCK:
        if key in _CACHE:
            return _CACHE[key]
    cls = {"hf": HFTokenizer, "tiktoken": TiktokenTokenizer, "sentencepiece": SentencePieceTokenizer}[kind]
    if kind == "hf" and not path.is_dir():
        raise TokenizerError(f"{path}: model.tokenizer: a Hugging Face tokenizer is a folder holding tokenizer.json")
    tok = cls(path, spec)
    with _CACHE_LOCK:
        _CACHE[key] = tok
    return tok


BPE_SPECIALS = ("<|endoftext|>",)  # id 0: the EOS of a trained BPE
#: a trained BPE for chats (train.task sft) also has ChatML's turn markers, and ChatML as its chat template
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Qwen2's ChatML without its default system prompt, and without {% generation %} markers (as most Hub templates)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
    "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _record_texts(path: Path) -> Iterator[str]:
    """Every string of every JSON record of a chat file (message contents, ShareGPT values, Alpaca fields)."""

    def strings(v):
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            for x in v.values():
                yield from strings(x)
        elif isinstance(v, list):
            for x in v:
                yield from strings(x)

    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # reported as file:line by the shard stage
            yield " ".join(s for s in strings(rec) if s and s not in ("system", "user", "assistant"))


def ensure_trained(spec: TokenizerSpec, dataset, chat: bool = False) -> bool:
    """`train_vocab`: train a byte-level BPE (`tokenizers`' BpeTrainer) on the dataset's local text and save
    tokenizer.json + tokenizer_config.json at `spec.path`, once (a folder already holding them is kept).
    Deterministic: the same corpus gives the same file. Written to a temporary folder, then renamed. `chat`
    (train.task sft): trained on the chats' strings, with ChatML's specials and template (EOS `<|im_end|>`).
    Returns True when it trained one."""
    if spec.train_vocab is None:
        return False
    if spec.path is None:
        raise TokenizerError("model.tokenizer.path: required with train_vocab (where the trained BPE is saved)")
    out = Path(spec.path).expanduser()
    if (out / "tokenizer.json").is_file():
        return False
    import shutil
    import tempfile

    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from nightloom.sharding.sources import list_sources, read_records

    def texts():
        for src in list_sources(dataset.path, dataset.format):
            if "://" in src.uri:
                raise TokenizerError(f"{src.uri}: train_vocab trains on local files only")
            if chat:
                yield from _record_texts(Path(src.uri))
                continue
            for _, text, _, err, _ in read_records(Path(src.uri), src.format, dataset.text_field, None):
                if err is None and text:
                    yield text

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.train_vocab,
        special_tokens=list(CHATML_SPECIALS if chat else BPE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    share_mode(tmp)  # mkdtemp makes 0700; other accounts read the cache too
    try:
        tok.save(str(tmp / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": BPE_SPECIALS[0],
            "bos_token": None,
            "model_max_length": 1 << 30,
            "clean_up_tokenization_spaces": False,
        }
        if chat:
            config |= {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE}
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "tokenizer.json").is_file():  # another process won the race: theirs is identical
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def resolve_vocab(model_spec, model_vocab: int) -> int:
    """Embedding rows of the run's model: the model's own, `model.vocab` as a number, or the tokenizer's size
    (`model.vocab: tokenizer`; a `train_vocab` tokenizer not trained yet counts as its requested size)."""
    v = model_spec.vocab
    if v is None:
        return model_vocab
    if isinstance(v, int):
        return v
    t = model_spec.tokenizer
    if t.train_vocab is not None and not (Path(t.path or "").expanduser() / "tokenizer.json").is_file():
        return t.train_vocab
    return load_tokenizer(t).vocab_size


def prepare_chat_tokenizer(spec) -> bool:
    """train.task sft with a `train_vocab` tokenizer: train it (ChatML specials and template) before the chat
    settings read its template; the sample chats are built first when the spec asks for them. True when trained."""
    tok, dataset = spec.model.tokenizer, spec.dataset
    if spec.train.task not in ("sft", "dpo") or tok.train_vocab is None or "://" in dataset.path:
        return False
    if dataset.sample:
        from nightloom.sharding.corpus import ensure_sample_corpus

        ensure_sample_corpus(dataset.path, kind=dataset.sample_kind)
    return ensure_trained(tok, dataset, chat=True)
