"""Typed records between the benchmark steps: a job for the lm-eval process, its scores, completions, rows."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nightloom.records import FrozenRecord, Record


class Score(FrozenRecord):
    """One metric of one task as lm-eval reports it (`acc,none` -> metric `acc`; other filters keep their name)."""

    task: str
    metric: str
    value: float
    stderr: float | None = None
    samples: int | None = None


class Completion(Record):
    """A prompt and one model's greedy completion of it."""

    prompt: str
    text: str


class ModelScores(Record):
    """What one model scored: its folder, scores, side-by-side completions and the seconds it took."""

    model_dir: str
    scores: list[Score] = Field(default_factory=list)
    completions: list[Completion] = Field(default_factory=list)
    seconds: float = 0.0
    cached: bool = False


#: the lm-eval settings a BenchJob takes from validate.benchmarks as they are, by the same names
SPEC_SETTINGS = tuple(
    "tasks include_path num_fewshot limit apply_chat_template fewshot_as_multiturn batch_size backend "
    "max_new_tokens".split()
)


class BenchJob(Record):
    """What the lm-eval process runs: models (each with its tokenizer folder), tasks and lm-eval's settings."""

    models: list[str]
    tokenizer: str | None = None  # a Hugging Face tokenizer folder for every model (the export's); None: each own
    tasks: list[str]
    include_path: str | None = None
    num_fewshot: int | None = None
    limit: float | None = None
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False
    batch_size: int = 8
    backend: Literal["auto", "hf", "vllm"] = "auto"  # lm-eval's backend, chosen on the node (engine.py)
    prompts: list[str] = Field(default_factory=list)
    max_new_tokens: int = 32
    output: str  # the result file (list of ModelScores as JSON), written whole then renamed

    def settings_key(self) -> dict:
        """The settings that change a score (not the models, the output or the prompts)."""
        return self.model_dump(exclude={"models", "output", "prompts", "max_new_tokens"})


class BenchResult(Record):
    """Base and tuned side by side: each model's scores (base None when not asked) and the seconds it all took."""

    tuned: ModelScores
    base: ModelScores | None = None
    seconds: float = 0.0
