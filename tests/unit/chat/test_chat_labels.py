"""nightloom.chat: records of each style as messages (bad ones refused with the reason), the prefix rule on a
ChatML template without generation markers, markers that agree or disagree, a template that renders earlier
turns differently, the EOS rule, and conversations cut at a turn boundary or dropped."""

from __future__ import annotations

import pytest

from nightloom.chat import ChatError, ChatRenderer, detect_style, template_text, to_messages
from tests.support.chat import (
    CHATML,
    CHATML_MARKED,
    CHATML_MARKED_SHORT,
    as_record,
    build_chat_tokenizer,
    chat_messages,
    prefix_rule_labels,
)

CONVERSATIONS = chat_messages(12, seed=4)


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat") / "tok")


@pytest.fixture(scope="module")
def hf(tokdir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tokdir))


@pytest.mark.parametrize("style", ["messages", "sharegpt", "alpaca"])
def test_each_style_is_detected_and_gives_the_same_messages(style):
    one_turn = [c for c in CONVERSATIONS if sum(m["role"] == "assistant" for m in c) == 1]
    for messages in one_turn:
        record = as_record(messages, style)
        assert detect_style(record) == style
        assert to_messages(record) == to_messages(record, style) == messages
    assert detect_style({"text": "plain"}) == "text"


def test_alpaca_input_follows_the_instruction_after_a_blank_line():
    got = to_messages({"instruction": "Add", "input": "1 2", "output": "3", "system": "Be brief"})
    assert got == [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Add\n\n1 2"},
        {"role": "assistant", "content": "3"},
    ]


BAD = {
    "unknown role": ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role: unknown role 'bot'"),
    "sharegpt role": ({"conversations": [{"from": "user", "value": "x"}]}, "conversations[0].from: unknown role"),
    "no messages": ({"messages": []}, "no messages: messages is empty"),
    "no chat fields": ({"text": "hi"}, "no messages"),
    "no assistant": ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
    "non-string": (
        {"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "y"}]},
        "messages[0].content: expected a string, got list",
    ),
    "null output": ({"instruction": "x", "output": None}, "output: expected a string, got null"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_records_are_refused_with_the_reason(case):
    record, reason = BAD[case]
    with pytest.raises(ChatError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        to_messages(record)


def test_prefix_rule_labels_exactly_the_assistant_turns_without_markers(tokdir, hf):
    r = ChatRenderer(tokdir, template_text(tokdir))
    assert not r.markers
    for messages in CONVERSATIONS:
        conv = r.render(messages)
        ids, labels = prefix_rule_labels(hf, messages)
        assert conv.ids == ids and conv.labels == labels and not conv.cut and not conv.eos_added
        said = hf.decode([i for i, lab in zip(conv.ids, conv.labels) if lab])
        want = "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
        assert said == want  # each assistant turn's content and end token, nothing of the prompts
        assert conv.text == hf.apply_chat_template(messages, tokenize=False)
    # the trap the issue names: without markers, transformers' own assistant mask is all zeros
    mask = hf.apply_chat_template(CONVERSATIONS[0], return_dict=True, return_assistant_tokens_mask=True)
    assert not any(mask["assistant_masks"])


def test_generation_markers_that_agree_are_accepted(tokdir):
    plain, marked = ChatRenderer(tokdir, CHATML), ChatRenderer(tokdir, CHATML_MARKED)
    assert marked.markers
    for messages in CONVERSATIONS:
        assert marked.render(messages) == plain.render(messages)


def test_generation_markers_that_disagree_are_refused(tokdir):
    r = ChatRenderer(tokdir, CHATML_MARKED_SHORT)
    with pytest.raises(ChatError, match=r"generation %\} mask and the prefix rule disagree at id \d+ \('Ċ'"):
        r.render(CONVERSATIONS[0])


def test_a_template_that_renders_a_turn_differently_later_is_refused(tokdir):
    last_differs = CHATML.replace(
        "{{ '<|im_start|>' + message['role']",
        "{% if loop.last %}{{ 'final ' }}{% endif %}{{ '<|im_start|>' + message['role']",
    )
    multi = next(c for c in CONVERSATIONS if sum(m["role"] == "assistant" for m in c) > 1)
    with pytest.raises(ChatError, match=r"messages\[\d\]: the template's ids of messages\[:\d\]"):
        ChatRenderer(tokdir, last_differs).render(multi)


def test_tokens_merging_across_the_generation_prompt_are_refused(tokdir):
    """A prompt ending in a space: BPE merges it with the reply's first word, so the prompt's ids are no prefix."""
    space = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    with pytest.raises(ChatError, match="with the generation prompt are not a prefix .* tokens merge across"):
        ChatRenderer(tokdir, space).render(CONVERSATIONS[1])


def test_template_refusal_and_a_leading_assistant_turn_are_chat_errors(tokdir):
    strict = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatError, match="roles must alternate"):
        ChatRenderer(tokdir, strict).render(CONVERSATIONS[0])
    with pytest.raises(ChatError, match="needs a turn before it"):
        ChatRenderer(tokdir, CHATML).render([{"role": "assistant", "content": "hi"}])


def test_eos_is_appended_only_when_the_assistant_turn_has_no_end_token(tokdir, hf):
    plain = (
        "{% for m in messages %}{{ m['role'] + ':\\n' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:\\n' }}{% endif %}"
    )
    conv = ChatRenderer(tokdir, plain).render(CONVERSATIONS[1])
    assert conv.eos_added and conv.ids[-1] == hf.eos_token_id and conv.labels[-1] == 1
    ends_with_user = CONVERSATIONS[1] + [{"role": "user", "content": "thanks"}]
    assert not ChatRenderer(tokdir, plain).render(ends_with_user).eos_added


def test_a_long_conversation_is_cut_after_a_whole_assistant_turn_or_dropped(tokdir):
    messages = next(c for c in CONVERSATIONS if sum(m["role"] == "assistant" for m in c) > 1)
    whole = ChatRenderer(tokdir, CHATML).render(messages)
    first_turn = messages[: next(i for i, m in enumerate(messages) if m["role"] == "assistant") + 1]
    first = ChatRenderer(tokdir, CHATML).render(first_turn)
    cut = ChatRenderer(tokdir, CHATML, seq_len=len(whole.ids) - 2).render(messages)
    assert cut.cut and cut.ids == first.ids and cut.labels == first.labels
    assert cut.text == ChatRenderer(tokdir, CHATML).text(first_turn)
    assert ChatRenderer(tokdir, CHATML, seq_len=len(whole.ids) - 1).render(messages) == whole  # seq_len + 1 fits
    assert ChatRenderer(tokdir, CHATML, seq_len=len(first.ids) - 2).render(messages) is None


def test_a_tokenizer_without_a_template_names_the_field_and_the_folder(tmp_path, tokdir):
    bare = build_chat_tokenizer(tmp_path / "bare", template=None)
    with pytest.raises(ChatError, match=f"model.chat_template: tokenizer {bare} has no chat template"):
        template_text(bare)
    (tmp_path / "t.jinja").write_text(CHATML)
    assert template_text(bare, tmp_path / "t.jinja") == CHATML
    (bare / "chat_template.jinja").write_text(CHATML_MARKED)  # what save_pretrained writes in transformers 5
    assert template_text(bare) == CHATML_MARKED
    with pytest.raises(ChatError, match="model.chat_template: file not found"):
        template_text(tokdir, tmp_path / "missing.jinja")


def test_the_prefix_rule_s_checks_name_both_renders_and_where_they_differ():
    """One check for the sft labels and the preference pairs: the id where a shorter render leaves the whole one."""
    from nightloom.chat import common_prefix, require_added, require_prefix

    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([1, 2], [1, 2, 3]) == 2
    require_prefix([1, 2], [1, 2, 3], "a", "b", "c")  # a prefix: nothing to say
    with pytest.raises(ChatError, match=r"^part ids are not a prefix of the whole's \(they differ at id 1\): why$"):
        require_prefix([1, 5], [1, 2, 3], "part ids", "the whole's", "why")
    with pytest.raises(ChatError, match=r"^messages\[3\]: the template adds no ids for this turn$"):
        require_added([1, 2], [1, 2], "messages[3]", "this turn")
