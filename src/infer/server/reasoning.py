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

from infer.server.tools import partial_suffix

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")
# split_reasoning's ``thinking``: True (the reply starts inside the thinking), None (it thinks
# if it opens with <think>); NO_PARSER: no --reasoning-parser (a reply is all content)
Thinking = bool | None | str
NO_PARSER = "no parser"


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
    return (
        reasoning if final else reasoning[: len(reasoning) - partial_suffix(reasoning, END)]
    ), ""


@dataclass
class ReasoningStream:
    """Splits a streamed reply: :meth:`feed` takes each new piece of text and returns the new
    reasoning and content it makes known (what :func:`split_reasoning` gives the whole reply).

    Work per piece is the piece's, not the reply's (a thinking reply runs to thousands of
    tokens): the opening is decided on the first few characters, then each piece is reasoning
    up to ``</think>`` (looked for in the piece and the few characters held back before it),
    and content after it.
    """

    thinking: bool | None
    phase: str = "opening"  # opening | reasoning | content
    head: str = ""  # the text while the opening is undecided
    held: str = ""  # reasoning that may be the start of </think>

    def feed(self, new_text: str, finished: bool) -> tuple[str, str]:
        if self.phase == "content":
            return "", new_text
        if self.phase == "opening":
            self.head += new_text
            body = self.head.lstrip()
            if START.startswith(body) and body != START and not finished:
                return "", ""  # blank so far, or a piece of <think>
            if body.startswith(START):
                new_text = body[len(START) :]
            elif self.thinking is None:  # it opened with something else: all content
                self.phase = "content"
                return "", self.head
            else:  # (the prompt opened the thinking)
                new_text = self.head
            self.phase = "reasoning"
        text = self.held + new_text
        reasoning, end, content = text.partition(END)
        if end:
            self.phase, self.held = "content", ""
            return reasoning, content
        keep = 0 if finished else partial_suffix(text, END)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], ""


def starts_thinking(parser: str | None, prompt_text: str, constrained: bool) -> bool | None:
    """The ``thinking`` of :func:`split_reasoning` for a reply to ``prompt_text`` (its last
    characters suffice); None also where no parser is set (see ``reasoning_parser``). A
    constrained reply's grammar holds from its first token, whatever the prompt opened: it is
    read as thinking only where it spells ``<think>`` itself."""
    if parser is None or constrained:
        return None
    if parser == "deepseek_r1" or prompt_text.rstrip().endswith(START):  # opened in the prompt
        return True
    return None
