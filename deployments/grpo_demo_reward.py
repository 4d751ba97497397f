"""The grpo-demo's verifiable reward (deployments/grpo-demo.yaml): a user function as train.grpo.rewards names it,
`reward(prompts, completions, **row) -> list[float]`, with the row's `answer` column (dataset.keep_columns)."""


def digits(prompts, completions, answer, **row):
    """Half for answering in digits (the share of the completion's characters that are digits), half when its
    first character is the row's answer (the sum of two digits 0-4: a one-digit answer)."""
    out = []
    for text, gold in zip(completions, answer, strict=True):
        share = sum(c.isdigit() for c in text) / max(len(text), 1)
        out.append(0.5 * share + 0.5 * float(text[:1] == str(gold)))
    return out
