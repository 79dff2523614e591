"""--reasoning-parser: a reply's thinking apart from its content, the same streamed or not,
whatever pieces the stream brings (a tag split over several)."""

from __future__ import annotations

import pytest

from infer.server.reasoning import ReasoningStream, split_reasoning, starts_thinking

CASES = [
    # (reply, thinking, (reasoning, content))
    ("<think>Let me see.</think>\n\n42", None, ("Let me see.", "\n\n42")),
    ("\n<think>a</think>b", None, ("a", "b")),
    ("The answer is 42.", None, ("", "The answer is 42.")),  # enable_thinking false
    ("42 <think>x</think>", None, ("", "42 <think>x</think>")),  # not at the start: content
    ("<think>cut by max_tokens", None, ("cut by max_tokens", "")),
    ("Let me see.</think>42", True, ("Let me see.", "42")),  # the template opened it
    ("<think>Let me see.</think>42", True, ("Let me see.", "42")),  # written anyway: dropped
    ("no end tag", True, ("no end tag", "")),
    ("a < b </thin </think> c", True, ("a < b </thin ", " c")),
    ("", None, ("", "")),
    ("<thi", None, ("", "<thi")),  # a tag's start, never finished: content
]


@pytest.mark.parametrize(("reply", "thinking", "want"), CASES)
def test_split(reply, thinking, want):
    assert split_reasoning(reply, thinking) == want


@pytest.mark.parametrize(("reply", "thinking", "want"), CASES)
@pytest.mark.parametrize("piece", [1, 2, 3, 5])
def test_a_stream_adds_up_to_the_unstreamed_split_and_never_takes_back(
    reply, thinking, want, piece
):
    stream = ReasoningStream(thinking)
    reasoning = content = ""
    pieces = [reply[i : i + piece] for i in range(0, len(reply), piece)] or [""]
    for i, new in enumerate(pieces):
        r, c = stream.feed(new, finished=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
        # nothing sent is a tag's piece: what is sent so far is a prefix of the final split
        assert want[0].startswith(reasoning) and want[1].startswith(content)
    assert (reasoning, content) == want


def test_where_a_reply_starts():
    assert starts_thinking("deepseek_r1", "<|Assistant|>", constrained=False) is True
    assert starts_thinking("qwen3", "<|im_start|>assistant\n", constrained=False) is None
    assert starts_thinking("qwen3", "<|im_start|>assistant\n<think>\n", constrained=False)
    # a grammar holds from the first token: it thinks only if it spells the tags
    assert starts_thinking("deepseek_r1", "<|Assistant|>", constrained=True) is None
    # ... even where the template opened the thinking (R1 distills, QwQ: the prompt ends with
    # <think>): the reply is the grammar's JSON, content (it was read as all reasoning)
    for parser in ("deepseek_r1", "qwen3"):
        assert starts_thinking(parser, "<|Assistant|><think>\n", constrained=True) is None
    assert starts_thinking(None, "<think>\n", constrained=False) is None


def test_random_replies_in_random_pieces():
    """Replies made of tag pieces, whitespace and text (unicode too), fed in random pieces: what
    a stream sends is always a prefix of the whole reply's split, and adds up to it."""
    import random

    rng = random.Random(7)
    parts = ["<think>", "</think>", "<thi", "nk>", "</th", "ink>", "<", "/", " ", "\n", "  \n ",
             "a", "word", "héllo", "日本", "🙂", "think", ">"]  # fmt: skip
    for _ in range(3000):
        reply = "".join(rng.choice(parts) for _ in range(rng.randint(0, 40)))
        for thinking in (None, True):
            want = split_reasoning(reply, thinking)
            stream, got = ReasoningStream(thinking), ["", ""]
            k = max(0, min(len(reply) - 1, rng.randint(0, 8)))
            cuts = sorted(rng.sample(range(1, len(reply)), k))
            pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True)]
            for i, piece in enumerate(pieces):
                r, c = stream.feed(piece, finished=i == len(pieces) - 1)
                got = [got[0] + r, got[1] + c]
                assert want[0].startswith(got[0]) and want[1].startswith(got[1]), (reply, pieces)
            assert tuple(got) == want, (reply, thinking, pieces)
