"""nightloom.chat_pairs: the three record forms of a preference pair (conversational, plain text, implicit prompt)
rendered by the prefix rule into one stored document, bad rows refused naming the field, keep_start truncation,
and the document split back into its chosen and rejected sequences."""

from __future__ import annotations

import pytest

from nightloom.chat import ChatError, ChatRenderer
from nightloom.chat_pairs import render_pair, split_pair, to_pair
from tests.support.chat import CHATML, build_chat_tokenizer

PROMPT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus two"}]
CHOSEN = [{"role": "assistant", "content": "four"}]
REJECTED = [{"role": "assistant", "content": "five and a half"}]


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("pairs") / "tok")


@pytest.fixture(scope="module")
def hf(tokdir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tokdir))


def _template_ids(hf, messages, gen=False):
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=gen)
    return list(out["input_ids"])


def _halves(conv):
    k = split_pair(conv.ids, conv.labels)
    return (conv.ids[:k], conv.labels[:k]), (conv.ids[k:], conv.labels[k:])


def test_conversational_pair_is_chosen_then_rejected_by_the_prefix_rule(tokdir, hf):
    conv = render_pair(
        ChatRenderer(tokdir, CHATML), to_pair({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED})
    )
    prompt_ids = _template_ids(hf, PROMPT, gen=True)
    for (ids, labels), completion in zip(_halves(conv), (CHOSEN, REJECTED)):
        assert ids == _template_ids(hf, PROMPT + completion)  # ChatML ends the turn with <|im_end|>: no EOS added
        assert labels == [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))
    assert not conv.cut


def test_implicit_prompt_is_the_shared_prefix(tokdir):
    r = ChatRenderer(tokdir, CHATML)
    explicit = render_pair(r, to_pair({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}))
    implicit = render_pair(r, to_pair({"chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED}))
    assert (implicit.ids, implicit.labels) == (explicit.ids, explicit.labels)


def test_plain_text_appends_eos_and_starts_the_completion_where_the_ids_differ(tokdir, hf):
    r = ChatRenderer(tokdir, CHATML)
    conv = render_pair(r, to_pair({"prompt": "alpha beta", "chosen": " gamma", "rejected": " delta delta"}))
    for (ids, labels), completion in zip(_halves(conv), (" gamma", " delta delta")):
        want = hf("alpha beta" + completion + hf.eos_token)["input_ids"]
        prompt = hf("alpha beta")["input_ids"]
        start = next(i for i, (a, b) in enumerate(zip([*prompt, None], want)) if a != b)
        assert ids == want and ids[-1] == hf.eos_token_id
        assert labels == [0] * start + [1] * (len(want) - start)


def test_keep_start_truncation_cuts_completions_and_drops_a_pair_without_one(tokdir, hf):
    prompt_len = len(_template_ids(hf, PROMPT, gen=True))
    pair = to_pair({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED})
    cut = render_pair(ChatRenderer(tokdir, CHATML, seq_len=prompt_len), pair)  # room for one completion id each
    (c, cl), (rj, rl) = _halves(cut)
    assert cut.cut and len(c) == len(rj) == prompt_len + 1 and sum(cl) == sum(rl) == 1
    assert render_pair(ChatRenderer(tokdir, CHATML, seq_len=prompt_len - 1), pair) is None


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": PROMPT, "chosen": CHOSEN}, "rejected: missing"),
        ({"prompt": PROMPT, "chosen": CHOSEN, "rejected": CHOSEN}, "rejected: equals chosen"),
        (
            {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": " "}], "rejected": REJECTED},
            "chosen[0].content: empty completion",
        ),
        ({"prompt": PROMPT, "chosen": [], "rejected": REJECTED}, "chosen: empty completion"),
        ({"prompt": "q", "chosen": "", "rejected": "no"}, "chosen: empty completion"),
        (
            {"prompt": [{"role": "bot", "content": "hi"}], "chosen": CHOSEN, "rejected": REJECTED},
            "prompt[0].role: unknown role 'bot'",
        ),
        (
            {"prompt": PROMPT, "chosen": CHOSEN, "rejected": [{"role": "user", "content": "x"}]},
            "rejected[0].role: a completion holds assistant turns only",
        ),
        ({"chosen": PROMPT + CHOSEN, "rejected": REJECTED}, "chosen, rejected: no shared prompt"),
        ({"chosen": PROMPT + CHOSEN, "rejected": PROMPT}, "rejected: empty completion"),
        ({"prompt": 3, "chosen": "a", "rejected": "b"}, "prompt: the plain-text form"),
    ],
)
def test_bad_rows_name_the_field(record, message):
    with pytest.raises(ChatError) as err:
        to_pair(record)
    assert str(err.value).startswith(message), str(err.value)


def test_split_pair_refuses_a_document_without_a_rejected_sequence():
    assert split_pair([5, 6, 7, 8, 9], [0, 1, 1, 0, 1]) == 3
    with pytest.raises(ValueError, match="no rejected sequence"):
        split_pair([5, 6, 7], [0, 1, 1])
