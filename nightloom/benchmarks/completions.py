"""Greedy completions of a few prompts by one model (transformers `generate`), for the side-by-side table."""

from __future__ import annotations

from nightloom.benchmarks.records import Completion


def complete(model_dir: str, tokenizer: str | None, prompts: list[str], max_new_tokens: int) -> list[Completion]:
    """Each prompt as a user turn through the chat template when the tokenizer has one (else as plain text),
    completed greedily; the new tokens decoded without special tokens."""
    if not prompts:
        return []
    import torch
    import transformers

    from nightloom.benchmarks.harness import model_args

    where = model_args(model_dir, tokenizer)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer or model_dir)
    if where.get("parallelize"):  # too big for one GPU: spread as lm-eval's HF backend did
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, device_map="auto", dtype="auto").eval()
        device = model.device
    else:
        device = where["device"]
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    out = []
    for prompt in prompts:
        if tok.chat_template:
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        else:
            text = prompt
        ids = tok(text, return_tensors="pt", add_special_tokens=not tok.chat_template).input_ids.to(device)
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
            )
        out.append(Completion(prompt=prompt, text=tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True).strip()))
    return out
