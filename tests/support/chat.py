"""Chat fine-tuning helpers: a tiny BPE tokenizer folder with a ChatML template, deterministic chat records in
each style, and the assistant-only NLL computed with transformers alone (the reference nightloom must equal)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench._support import WORDS

#: the tiny Qwen2 the chat fine-tuning tests train (vocab covers build_chat_tokenizer's ids)
QWEN2 = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.1,
}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Qwen2's ChatML without its default system prompt and without {% generation %} markers (most Hub templates)
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
    "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: the same template with generation markers around everything an assistant turn adds after its header
CHATML_MARKED = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: markers that leave the newline after <|im_end|> out: the prefix rule counts it, so the two disagree
CHATML_MARKED_SHORT = CHATML_MARKED.replace(
    "{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}",
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}",
)


def build_chat_tokenizer(
    folder: Path, template: str | None = CHATML, vocab: int = 320, eos: str = "<|im_end|>"
) -> Path:
    """A byte-level BPE (`tokenizers`) with the ChatML specials, and tokenizer_config.json holding `template`
    (none when None). Deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(3)
    texts = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "bos_token": None,
        "pad_token": "<|endoftext|>",
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
    }
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def _says(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def chat_messages(n: int, seed: int = 0, long_every: int = 0) -> list[list[dict]]:
    """`n` distinct conversations: some with a system turn, some multi-turn; every `long_every`-th one long."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": _says(rng, 2, 5)}] if i % 3 == 0 else []
        for _ in range(1 + (i % 4 == 1) + (i % 5 == 2)):
            msgs.append({"role": "user", "content": f"q{i} " + _says(rng, 2, 8)})
            long = long_every and i % long_every == long_every - 1
            msgs.append({"role": "assistant", "content": _says(rng, 20, 40) if long else _says(rng, 1, 10)})
        out.append(msgs)
    return out


def as_record(messages: list[dict], style: str) -> dict:
    """The conversation as one record of `style` (messages, sharegpt; alpaca for system? + user + assistant)."""
    if style == "messages":
        return {"messages": messages}
    if style == "sharegpt":
        names = {"user": "human", "assistant": "gpt", "system": "system"}
        return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}
    system = [m["content"] for m in messages if m["role"] == "system"]
    user, assistant = (next(m["content"] for m in messages if m["role"] == r) for r in ("user", "assistant"))
    return {"instruction": user, "input": "", "output": assistant, **({"system": system[0]} if system else {})}


def write_chats(path: Path, conversations: list[list[dict]], style: str = "messages") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(as_record(c, style)) + "\n" for c in conversations), encoding="utf-8")
    return path


def prefix_rule_labels(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, labels) by the prefix rule, straight from transformers' apply_chat_template."""

    def ids(msgs, gen=False):
        return list(
            tok.apply_chat_template(msgs, tokenize=True, return_dict=True, add_generation_prompt=gen)["input_ids"]
        )

    full = ids(messages)
    labels = [0] * len(full)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            a, b = ids(messages[:i], gen=True), ids(messages[: i + 1])
            assert full[: len(b)] == b and full[: len(a)] == a
            labels[len(a) : len(b)] = [1] * (len(b) - len(a))
    return full, labels


def transformers_sft_nll(model_dir: Path, tokenizer_dir: Path, conversations: list[list[dict]]) -> tuple[float, int]:
    """Mean NLL over the assistant tokens (prefix rule) of every conversation with transformers' model and
    tokenizer alone, and their count."""
    import torch
    import torch.nn.functional as F
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total, count = 0.0, 0
    for messages in conversations:
        ids, labels = prefix_rule_labels(tok, messages)
        mask = torch.tensor(labels[1:], dtype=torch.bool)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        total += float(F.cross_entropy(logits[mask], torch.tensor(ids[1:])[mask], reduction="sum").double())
        count += int(mask.sum())
    return total / count, count
