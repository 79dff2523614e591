"""Reasoning outputs: a thinking model's ``<think> ... </think>`` apart from its answer.

With ``--reasoning-parser`` a chat reply's thinking goes in the message's ``reasoning`` field
(and ``reasoning_content``, its older name, which clients of vLLM read too) and only the rest in
``content``; tool calls are parsed from that rest. The two parsers are vLLM's:

- ``deepseek_r1`` (DeepSeek R1 and its distills, QwQ): the template opens the thinking in the
  prompt, so the reply starts inside it (a ``<think>`` the model writes anyway is dropped):
  everything up to ``</think>`` is reasoning. A reply cut before ``</think>`` is all reasoning.
- ``qwen3`` (Qwen3): the reply thinks when it starts with ``<think>`` (after any whitespace), or
  when the prompt ends inside an open ``<think>`` (templates that open it there). A reply that
  does neither (``enable_thinking: false`` in ``chat_template_kwargs``) is all content.

A constrained reply (structured outputs, a tool choice that forces calls) is read as ``qwen3``
reads any reply: its grammar holds from its first token, so it thinks only if the grammar spells
the tags. Streamed, the text that may be the start of a tag is held back until it is known
not to be one; what a stream sends adds up to what the same reply gives unstreamed::

    reply:   "<think>" "Let me" " see.</th" "ink>" "\\n\\n42"
    stream:  -         r"Let me" r" see."   -      c"\\n\\n42"     (r: reasoning, c: content)
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")
# split_reasoning's ``thinking``: True (the reply starts inside the thinking), None (it thinks
# if it opens with <think>); NO_PARSER: no --reasoning-parser (a reply is all content)
Thinking = bool | None | str
NO_PARSER = "no parser"


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that starts ``tag`` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reasoning(text: str, thinking: bool | None, final: bool = True) -> tuple[str, str]:
    """``(reasoning, content)`` of a reply's ``text``. ``thinking``: True when the reply starts
    inside the thinking, None when it thinks only if it opens with ``<think>``. Not ``final``:
    the text so far of a streamed reply, without what may yet be part of a tag."""
    if thinking is None:
        stripped = text.lstrip()
        if stripped.startswith(START):
            thinking = True
        elif not final and START.startswith(stripped):  # (blank, or the tag's beginning)
            return "", ""
        else:
            return "", text
    body = text.lstrip()
    if body.startswith(START):
        text = body[len(START) :]
    elif not final and START.startswith(body):
        return "", ""
    reasoning, end, content = text.partition(END)
    if end:
        return reasoning, content
    return (reasoning if final else reasoning[: len(reasoning) - _partial_tag(reasoning, END)]), ""


@dataclass
class ReasoningStream:
    """Splits a streamed reply: :meth:`feed` takes each new piece of text and returns the new
    reasoning and content it makes known."""

    thinking: bool | None
    text: str = ""
    sent_reasoning: int = 0
    sent_content: int = 0

    def feed(self, new_text: str, finished: bool) -> tuple[str, str]:
        self.text += new_text
        reasoning, content = split_reasoning(self.text, self.thinking, final=finished)
        out = reasoning[self.sent_reasoning :], content[self.sent_content :]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return out


def starts_thinking(parser: str | None, prompt_text: str, constrained: bool) -> bool | None:
    """The ``thinking`` of :func:`split_reasoning` for a reply to ``prompt_text`` (its last
    characters suffice); None also where no parser is set (see ``reasoning_parser``)."""
    if parser == "deepseek_r1" and not constrained:
        return True
    tail = prompt_text.rstrip()
    if parser is not None and tail.endswith(START):  # the template opened the thinking
        return True
    return None
