"""train.grpo's prompts through the tokenizer's chat template, as TRL's GRPOTrainer renders a conversational
prompt: transformers' `apply_chat_template` with the generation prompt added (nightloom.chat.ChatRenderer, the
template the sft path uses: model.chat_template or the tokenizer's own).

A prompt is chat-shaped when its text is a list of {role, content} messages JSON-encoded (nightloom.chat's
`prompt_messages`: a validate.eval_data record's messages list is read so; the shard stage stores a messages list
in the text field as its JSON text, so a shard's chat prompt is that JSON text); `train.grpo.chat_template` true renders a plain text as one user message too,
false renders nothing (a chat-shaped prompt is then refused, never fed to the model as JSON)."""

from __future__ import annotations

from pathlib import Path

from nightloom.chat import ChatError, ChatRenderer, prompt_messages, template_text


class PromptTemplate:
    """Prompt texts -> ids through one tokenizer folder's chat template, the generation prompt added."""

    def __init__(self, tokenizer_dir: str | Path, chat_template: str | Path | None, always: bool):
        self.renderer = ChatRenderer(tokenizer_dir, template_text(tokenizer_dir, chat_template))
        self.always = always

    def ids(self, text: str) -> list[int] | None:
        """The rendered ids of a chat-shaped prompt (or of any prompt when `always`), else None (plain text, the
        tokenizer's own encoding)."""
        messages = prompt_messages(text)
        if messages is None and not self.always:
            return None
        return self.renderer.ids(messages or [{"role": "user", "content": text}], generation_prompt=True)


def prompt_template(
    setting: bool | None, texts: list[str], tokenizer_dir: str | None, chat_template
) -> PromptTemplate | None:
    """The PromptTemplate train.grpo.chat_template asks for over these prompt texts (None: none needed). ChatError
    naming the field when a chat-shaped prompt meets chat_template false or a tokenizer with no template."""
    chat = next((i for i, t in enumerate(texts) if prompt_messages(t) is not None), None)
    if setting is False:
        if chat is not None:
            raise ChatError(
                f"train.grpo.chat_template: false, but prompt {chat} is a list of messages (chat-shaped): set it "
                "to true or leave it out to render chats with the tokenizer's chat template"
            )
        return None
    if setting is None and chat is None:
        return None
    if not tokenizer_dir or not Path(tokenizer_dir).expanduser().is_dir():
        raise ChatError(
            "model.tokenizer: train.grpo renders chat prompts with transformers' apply_chat_template, which needs a "
            f"Hugging Face tokenizer folder with a chat template, got {tokenizer_dir or 'bytes'!r}"
        )
    return PromptTemplate(tokenizer_dir, chat_template, always=bool(setting))
