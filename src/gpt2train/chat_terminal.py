"""`gpt2train chat`: a conversation with a chat model in the terminal, its replies printed as they are generated.

A ChatSession keeps the history (the messages so far) and builds each turn's prompt with the chat template
(chat.fit_prompt): the newest messages that fit in the model's context beside the reply's room, the oldest
dropped first. talk() is the loop: a line from the user, the reply streamed, until /exit or the end of input.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TextIO

from gpt2train.chat import ConversationError, fit_prompt, has_chat_tokens
from gpt2train.generation import Decoder, TextStream, generate_stream
from gpt2train.model import GPT
from gpt2train.ranges import SEEDS, UsageError

COMMANDS = {"/reset": "clears the history", "/exit": "ends the chat (as Ctrl-D does)"}


def check_chat_model(tokenizer, name: str) -> None:
    """A UsageError, in one line, for a model that was never fine-tuned on conversations: without the turn
    tokens it cannot tell its reply from the user's, so it would only continue the text."""
    if not has_chat_tokens(tokenizer):
        raise UsageError(f"{name} was not fine-tuned on conversations (its tokenizer has no <|im_start|>/<|im_end|> "
                         "turn tokens); fine-tune it on `gpt2train prepare chat` data first (docs/chat.md)")


def reply_budget(block_size: int, max_tokens: int | None) -> int:
    """The tokens a reply may take: --max-tokens, or half the context by default; the rest is the prompt's."""
    if max_tokens is None:
        return block_size // 2
    if max_tokens >= block_size:
        raise UsageError(f"--max-tokens {max_tokens} leaves no room for the conversation in the model's "
                         f"{block_size}-token context; give at most {block_size - 1} (a quarter to a half is usual)")
    return max_tokens


class ChatSession:
    """One conversation with a chat model: send() a user message, then reply() streams the answer's text and
    adds it to the history. Each reply draws with a seed of its own (seed + its number), so a conversation
    is reproducible from its seed."""

    def __init__(self, model: GPT, tokenizer, *, system: str | None = None, max_tokens: int | None = None,
                 temperature: float = 0.8, top_k: int = 200, top_p: float = 1.0, seed: int = 1337,
                 decoder: Decoder | None = None):
        check_chat_model(tokenizer, "the model")
        self.model, self.tokenizer = model, tokenizer
        self.context = model.config.block_size
        self.max_tokens = reply_budget(self.context, max_tokens)
        self.system = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.system)
        self.options = dict(temperature=temperature, top_k=top_k, top_p=top_p, eot_id=tokenizer.im_end_id,
                            decoder=decoder or Decoder(model, compile=False))
        self.seed, self.replies = seed, 0
        self.prompt: list[int] | None = None
        self.finished = True  # whether the last reply ended its turn (<|im_end|>) rather than at max_tokens

    def reset(self) -> None:
        """Forget the conversation; the system message stays."""
        self.messages = list(self.system)
        self.prompt = None

    def send(self, text: str) -> int:
        """Add the user's message and build the reply's prompt; returns how many of the oldest messages it
        leaves out. A message too long for the context alone raises ConversationError and is not kept."""
        messages = [*self.messages, {"role": "user", "content": text}]
        self.prompt, dropped = fit_prompt(self.tokenizer, messages, budget=self.context - self.max_tokens)
        self.messages = messages
        return dropped

    def reply(self) -> Iterator[str]:
        """The reply's text as it is generated (the closing <|im_end|> is not text); at its end the reply joins
        the history."""
        if self.prompt is None:
            raise ValueError("send() a user message before asking for a reply")
        seed = (self.seed + self.replies) % (SEEDS.high + 1)
        self.replies += 1
        stream, ids = TextStream(self.tokenizer), []
        self.finished = False
        for token in generate_stream(self.model, self.prompt, self.max_tokens, seed=seed, **self.options):
            if token == self.tokenizer.im_end_id:
                self.finished = True
                break
            ids.append(token)
            yield stream.push(token)
        yield stream.flush()
        self.messages.append({"role": "assistant", "content": self.tokenizer.decode(ids)})
        self.prompt = None


def user_lines(stdin: TextIO) -> Iterator[str]:
    """The user's lines, without their newline, until the end of input; prompted with "you> " on a terminal
    (input() then gives line editing), silent when the lines come from a pipe or a file."""
    if stdin.isatty():
        while True:
            try:
                yield input("you> ")
            except EOFError:  # Ctrl-D: end the prompt's line, as a shell does
                print()
                return
            except KeyboardInterrupt:  # Ctrl-C: the same, then the command stops (exit 130)
                print()
                raise
    for line in stdin:
        yield line.removesuffix("\n")


def talk(session: ChatSession, lines: Iterable[str], out: TextIO, err: TextIO) -> int:
    """The chat loop: each line is a command or a user message whose reply is printed on `out` as it comes;
    notices (history cropped, a reply cut short, a message too long) go to `err`, one line each. Returns 0 at
    /exit or the end of the lines."""
    for line in lines:
        command = line.strip()
        if command == "/exit":
            break
        if command == "/reset":
            session.reset()
            print("(history cleared)", file=err, flush=True)
            continue
        if not command:
            continue
        try:
            dropped = session.send(line)
        except ConversationError as e:
            print(f"(not sent: {e}; write a shorter message)", file=err, flush=True)
            continue
        if dropped:
            print(f"(history cropped: the oldest {dropped} message{'s' if dropped > 1 else ''} no longer fit the "
                  f"{session.context}-token context, {session.max_tokens} of its tokens kept for the reply)", file=err,
                  flush=True)
        try:
            for text in session.reply():
                print(text, end="", file=out, flush=True)
        except KeyboardInterrupt:  # Ctrl-C mid-reply: end the line, so the shell's prompt starts on its own
            print(file=out, flush=True)
            raise
        print(file=out, flush=True)
        if not session.finished:
            print(f"(reply cut at {session.max_tokens} tokens: --max-tokens)", file=err, flush=True)
    return 0
