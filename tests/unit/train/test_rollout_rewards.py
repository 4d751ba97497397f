"""Reward functions (nightloom.rewards: the built-ins and resolving; nightloom.train.rollout.rewards: scoring): the
built-ins' scores, the user's own functions loaded from a file beside the spec or a module, and every way a
function is refused by name."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from nightloom.rewards.builtins import final_answer
from nightloom.train.rollout.rewards import RewardError, RewardRef, load_reward, load_rewards, score


def _run(ref: RewardRef, completions, base_dir=".", **columns):
    rewards = [load_reward(ref, base_dir)]
    ids = [[1] * len(c) for c in completions]
    return score(rewards, ["q"] * len(completions), completions, ids, columns).per_fn[:, 0].tolist()


def test_accuracy_compares_math_as_expressions_and_text_as_text():
    completions = [
        "Half of one is \\boxed{\\frac{1}{2}}",
        "so the answer is 0.5",
        "the answer: 1/3",
        "Paris",
        "answer is paris.",
        "London",
    ]
    answers = ["0.5", "1/2", "1/2", "Paris", "Paris", "Paris"]
    assert _run(RewardRef("accuracy"), completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert final_answer("work\nmore work\n 42 ") == "42"


def test_format_and_length_builtins():
    fmt = RewardRef("format", args={"pattern": r"<think>.*</think>\s*<answer>.*</answer>"})
    good, bad = "<think>a\nb</think> <answer>3</answer>", "<answer>3</answer>"
    assert _run(fmt, [good, bad]) == [1.0, 0.0]
    ln = RewardRef("length", args={"max_tokens": 10, "cache_tokens": 4})
    # DAPO: 0 up to 6 tokens, then -(n-6)/4, -1 past 10
    assert _run(ln, ["x" * 6, "x" * 8, "x" * 10, "x" * 12]) == [0.0, -0.5, -1.0, -1.0]


def test_builtin_args_are_checked():
    with pytest.raises(RewardError, match=r"rewards: built-in format takes args \['pattern'\]; missing \['pattern'\]"):
        load_reward(RewardRef("format"))
    with pytest.raises(RewardError, match=r"unknown \['max_len'\]"):
        load_reward(RewardRef("length", args={"max_tokens": 4, "cache_tokens": 2, "max_len": 3}))


def test_weighted_total_and_per_function_columns():
    rewards = load_rewards([RewardRef("accuracy", 2.0), RewardRef("format", 0.5, {"pattern": r"\d+"})])
    s = score(rewards, ["a", "b"], ["7", "x"], [[1], [2]], {"answer": ["7", "7"]})
    assert s.names == ("accuracy", "format")
    assert torch.equal(s.per_fn, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert s.total.tolist() == [2.5, 0.0]


USER = """
def brevity(prompts, completions, **row):
    return [1.0 / (1 + len(c)) for c in completions]

def uses_column(prompts, completions, difficulty, **row):
    return [float(d) for d in difficulty]

def no_kwargs(prompts, completions):
    return [0.0] * len(completions)

def one_arg(completions, **row):
    return [0.0] * len(completions)

def short(prompts, completions, **row):
    return [1.0]

def nan(prompts, completions, **row):
    return [float("nan")] * len(completions)

def not_list(prompts, completions, **row):
    return 1.0

def boom(prompts, completions, **row):
    raise KeyError("answer")

NOT_FN = 3
"""


@pytest.fixture
def user_file(tmp_path):
    (tmp_path / "rw").mkdir()
    (tmp_path / "rw" / "mine.py").write_text(textwrap.dedent(USER))
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    return tmp_path


def test_user_function_from_a_file_relative_to_the_spec(user_file):
    assert _run(RewardRef("rw/mine.py:brevity"), ["abc", ""], base_dir=user_file) == [0.25, 1.0]
    assert _run(RewardRef("rw/mine.py:uses_column"), ["a", "b"], base_dir=user_file, difficulty=[2, 3]) == [2.0, 3.0]


def test_user_function_from_a_module(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file / "rw"))
    try:
        assert _run(RewardRef("mine:brevity"), ["a"]) == [0.5]
    finally:
        sys.modules.pop("mine", None)


@pytest.mark.parametrize(
    "fn, message",
    [
        ("rw/mine.py:missing", r"rewards\[0\]: .*mine.py has no function 'missing'"),
        ("rw/none.py:f", r"rewards\[0\]: no file .*none.py"),
        ("broken.py:f", r"rewards\[0\]: importing .*broken.py failed: ModuleNotFoundError"),
        ("not_a_module_anywhere:f", r"importing module 'not_a_module_anywhere' failed"),
        ("rw/mine.py:no_kwargs", r"rw/mine.py:no_kwargs must accept \*\*row"),
        ("rw/mine.py:one_arg", r"must take \(prompts, completions, \*\*row\)"),
        ("rw/mine.py:NOT_FN", r"rw/mine.py:NOT_FN is not a function"),
        ("accuracyy", r"'accuracyy' is neither a built-in"),
    ],
)
def test_unusable_functions_are_refused_at_load(user_file, fn, message):
    with pytest.raises(RewardError, match=message):
        load_rewards([RewardRef(fn)], user_file)


@pytest.mark.parametrize(
    "fn, message",
    [
        ("short", r"reward rw/mine.py:short returned 1 scores for 2 completions"),
        ("nan", r"reward rw/mine.py:nan: score 0 is nan, not a finite number"),
        ("not_list", r"reward rw/mine.py:not_list returned float, not a list of 2 floats"),
        ("boom", r"reward rw/mine.py:boom raised KeyError: 'answer'"),
    ],
)
def test_bad_results_fail_the_step_naming_the_function(user_file, fn, message):
    with pytest.raises(RewardError, match=message):
        _run(RewardRef(f"rw/mine.py:{fn}"), ["a", "b"], base_dir=user_file)
