"""The chat template: a conversation rendered to token ids and the loss mask that says which of them train.

ChatML, the template llama.cpp, Ollama and transformers all recognise, one block per message:

    <|im_start|>{role}\\n{content}<|im_end|>\\n

The turn tokens are ids of their own (tokenizer.ChatTokens), never text: a user who types "<|im_end|>" gets
ordinary tokens. Only what the model should learn to say trains: each assistant message's content and the
<|im_end|> that closes it. The role header, the newline after <|im_end|> and every other message are context.
A conversation starts with the end-of-text token, as a pretraining document does. The exports carry the same
template as Jinja (JINJA_TEMPLATE), for transformers and llama.cpp to render.
"""

from __future__ import annotations

import numpy as np

from gpt2train.tokenizer import ChatTokens

ROLES = ("system", "user", "assistant")

# The template as Jinja, for the tools that render a conversation to text themselves and then tokenize it
# (transformers' apply_chat_template, llama.cpp): the exports write it beside the tokenizer. Their `bos_token` is
# the end-of-text token, and the turn tokens' text is parsed back into their ids, so it gives render_prompt's ids.
JINJA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ConversationError(ValueError):
    """A conversation the template cannot render; the message says what is wrong with it."""


def check_conversation(row) -> list[dict]:
    """The messages of a {"messages": [...]} row (OpenAI's fine-tuning format), checked: each has a known role
    and text content, and at least one is the assistant's (else nothing would train)."""
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        found = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ConversationError(f"has no \"messages\" list (found {found})")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else message
            raise ConversationError(f"message {i} has role {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ConversationError(f"message {i} ({message['role']}) has no text \"content\"")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConversationError("has no assistant message, so nothing in it would train")
    return messages


def render(tokenizer: ChatTokens, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one conversation: int64 ids, and a uint8 mask that is 1 where the id is a target the loss
    counts (assistant content and its <|im_end|>)."""
    newline = tokenizer.encode("\n")
    ids, mask = [tokenizer.eot_id], [0]

    def add(part: list[int], trains: bool) -> None:
        ids.extend(part)
        mask.extend([int(trains)] * len(part))

    for message in messages:
        trains = message["role"] == "assistant"
        add([tokenizer.im_start_id, *tokenizer.encode(message["role"]), *newline], False)
        add([*tokenizer.encode(message["content"]), tokenizer.im_end_id], trains)
        add(newline, False)
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def render_text(messages: list[dict]) -> str:
    """The template as text (what ChatTokens.decode gives back for render's ids, less the leading end-of-text)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def check_messages(messages) -> list[dict]:
    """The messages of a chat request (the server's, the terminal's): each has a known role and text content,
    and the last is not the assistant's (the reply is what comes next)."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError("\"messages\" must be a non-empty list of {\"role\", \"content\"}")
    check_conversation({"messages": [*messages, {"role": "assistant", "content": ""}]})
    if messages[-1]["role"] == "assistant":
        raise ConversationError("the last message is the assistant's; end with the user's turn to get a reply")
    return messages


def render_prompt(tokenizer: ChatTokens, messages: list[dict]) -> list[int]:
    """The ids a reply is generated after: the conversation as training rendered it, then the assistant's header
    (<|im_start|>assistant\\n). The reply ends at <|im_end|>."""
    ids, _ = render(tokenizer, messages)
    return [*ids.tolist(), tokenizer.im_start_id, *tokenizer.encode("assistant"), *tokenizer.encode("\n")]


def fit_prompt(tokenizer: ChatTokens, messages: list[dict], budget: int) -> tuple[list[int], int]:
    """(ids, dropped): the prompt of the newest messages that fits in `budget` tokens, dropping the oldest
    messages first (a leading system message is kept while anything else can go). The last message is never
    dropped: one that does not fit alone raises ConversationError."""
    system = messages[:1] if messages[0]["role"] == "system" else []
    rest = messages[len(system):]
    for dropped in range(len(rest)):
        ids = render_prompt(tokenizer, system + rest[dropped:])
        if len(ids) <= budget:
            return ids, dropped
    if system:  # the system message itself is what does not fit beside the last message
        ids = render_prompt(tokenizer, rest[-1:])
        if len(ids) <= budget:
            return ids, len(messages) - 1
    raise ConversationError(f"the last message alone takes {len(render_prompt(tokenizer, messages[-1:]))} tokens "
                            f"of the prompt; the model's context leaves {budget} for it")


def has_chat_tokens(tokenizer) -> bool:
    """Whether a model's tokenizer was trained with the template (its spec's "chat" key: tokenizer_from_spec
    rebuilt a ChatTokens)."""
    return isinstance(tokenizer, ChatTokens)
