"""Benchmark helpers: a tiny Qwen2 folder with its ChatML tokenizer, and a local lm-eval task folder holding a
multiple-choice task and a generative one (relative data_files, as users write them)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from bench._support import WORDS
from tests.support.chat import QWEN2, build_chat_tokenizer

MC_TASK, GEN_TASK = "nl_mc", "nl_gen"


def tiny_model(folder: Path, seed: int = 0) -> Path:
    """A random tiny Qwen2 saved with its tokenizer (a Hugging Face folder as a run's export is)."""
    import torch
    import transformers

    tok_dir = build_chat_tokenizer(folder.parent / f"{folder.name}-tok")
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(**QWEN2, max_position_embeddings=512, tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(folder)
    for f in tok_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def qa_pairs(n: int, seed: int = 1) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [
        (f"q{i} " + " ".join(rng.choice(WORDS) for _ in range(4)), " ".join(rng.choice(WORDS) for _ in range(3)))
        for i in range(n)
    ]


def write_tasks(folder: Path, pairs: list[tuple[str, str]], gen_targets: list[str] | None = None) -> Path:
    """`nl_mc` (the right answer among three others, one shot, acc and acc_norm) and `nl_gen` (generate until a newline,
    exact_match against gen_targets, default the answers) as YAML + JSONL in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(pairs)
    with (folder / "mc.jsonl").open("w") as f:
        for i, (q, _a) in enumerate(pairs):
            choices = [pairs[(i + k) % n][1] for k in range(4)]
            gold = i % 4
            choices[0], choices[gold] = choices[gold], choices[0]
            f.write(json.dumps({"question": q, "choices": choices, "gold": gold}) + "\n")
    targets = gen_targets or [a for _, a in pairs]
    with (folder / "gen.jsonl").open("w") as f:
        for (q, _), t in zip(pairs, targets, strict=True):
            f.write(json.dumps({"question": q, "answer": t}) + "\n")
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {file}\ntest_split: test\n"
    (folder / "mc.yaml").write_text(
        f"task: {MC_TASK}\n" + common.format(file="mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "Q: {{question}}\\nA:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{gold}}"\n'
        "num_fewshot: 1\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (folder / "gen.yaml").write_text(
        f"task: {GEN_TASK}\n" + common.format(file="gen.jsonl") + "output_type: generate_until\n"
        'doc_to_text: "Q: {{question}}\\nA:"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


def chatml(q: str, a: str) -> str:
    """One user turn and its answer, rendered as the demos' ChatML template renders them."""
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"


def train_on(
    model_dir: Path, texts: list[str], out: Path, steps: int = 60, lr: float = 1e-2, tokenizer: Path | None = None
) -> Path:
    """Full-batch AdamW on the texts (every token a label), saved (then renamed) with its tokenizer (`tokenizer`,
    else model_dir's): a real model that learned them."""
    import torch
    import transformers

    tok_dir = Path(tokenizer or model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(0)
    for _ in range(steps):
        model(**batch, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in tok_dir.glob("tokenizer*"):
        shutil.copy(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
