"""The conversation renderer the server and the offline API share: what a template receives
(content parts as a list only for templates that loop over them, tool-call arguments as objects,
documents and tools), and the options checked by name."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from infer.core.sampling_params import InvalidRequestError
from infer.model.chat_template import loops_over_content, render_chat_ids

STRING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function']['arguments'] | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% for d in documents or [] %}<doc>{{ d['text'] }}</doc>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Loops over each message's content, as Gemma 3's and Llama 4's templates do.
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{% for part in m['content'] %}[{{ part['text'] }}]"
    "{% endfor %}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def tok(tiny_checkpoints):
    """The test tokenizer, adding a BOS to what it encodes (as Llama's do)."""
    from tokenizers.processors import TemplateProcessing

    tok = AutoTokenizer.from_pretrained(tiny_checkpoints["llama"])
    bos = (tok.bos_token, tok.bos_token_id)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos[0]} $A", pair=f"{bos[0]} $A $B", special_tokens=[bos]
    )
    assert tok.encode("x")[0] == tok.bos_token_id
    return tok


def _text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False)


def test_content_parts_reach_a_template_in_the_form_it_reads(tok):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                             {"type": "text", "text": "world"}]},
                {"role": "assistant", "content": "plain"}]  # fmt: skip
    assert loops_over_content(PARTS_TEMPLATE) and not loops_over_content(STRING_TEMPLATE)
    parts = render_chat_ids(tok, messages, chat_template=PARTS_TEMPLATE,
                            add_generation_prompt=False)  # fmt: skip
    assert _text(tok, parts) == "user:[hello][world]assistant:[plain]"  # (trim_blocks)
    joined = render_chat_ids(tok, messages, chat_template=STRING_TEMPLATE,
                             add_generation_prompt=False)  # fmt: skip
    assert "user\nhello\nworld<|im_end|>" in _text(tok, joined)


def test_tool_call_arguments_documents_and_special_tokens(tok):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {
                    "name": "get", "arguments": json.dumps({"city": "Paris"})}}]}]  # fmt: skip
    ids = render_chat_ids(tok, messages, chat_template=STRING_TEMPLATE,
                          documents=[{"text": "doc one"}])  # fmt: skip
    text = _text(tok, ids)
    assert '<tool_call>{"city": "Paris"}</tool_call>' in text  # an object, not a JSON string
    assert "<doc>doc one</doc>" in text and text.endswith("<|im_start|>assistant\n")
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id  # the template's one BOS
    twice = render_chat_ids(tok, messages, chat_template=STRING_TEMPLATE, add_special_tokens=True,
                            documents=[{"text": "doc one"}])  # fmt: skip
    assert twice == [tok.bos_token_id, *ids]  # asked for: the tokenizer's BOS too


@pytest.mark.parametrize(
    ("options", "param", "message"),
    [
        ({"template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set tools"),
        ({"continue_final_message": True}, "continue_final_message", "exclusive"),
        ({"continue_final_message": True, "add_generation_prompt": False},
         "continue_final_message", "needs a final assistant message"),
        ({"chat_template": "{{ raise_exception('no system role') }}"}, "messages", "no system"),
    ],
)  # fmt: skip
def test_inconsistent_options_are_named(tok, options, param, message):
    with pytest.raises(InvalidRequestError, match=message) as e:
        render_chat_ids(tok, [{"role": "user", "content": "x"}], **options)
    assert e.value.param == param


def test_a_part_that_is_not_text_is_named(tok):
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]
    with pytest.raises(InvalidRequestError, match="must be text parts") as e:
        render_chat_ids(tok, audio)
    assert e.value.param == "messages[0].content[0]"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(InvalidRequestError, match="this model reads no images") as e:
        render_chat_ids(tok, image)  # (no image_token: a text model's template)
    assert e.value.param == "messages[0].content[0]"


def test_image_parts_are_placeholders_in_order(tok):
    """A template that loops over the parts gets ``{"type": "image"}``; any other the
    placeholder's text among the texts, and the images come back in the parts' order."""
    from infer.model.chat_template import message_images

    messages = [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u1"}},
        {"type": "image_pil", "image_pil": "pil"}, {"type": "text", "text": "b"}]}]  # fmt: skip
    text = tok.decode(render_chat_ids(tok, messages, image_token="<IMG>",
                                      chat_template="{{ messages[0]['content'] }}"))  # fmt: skip
    assert text == "a\n<IMG>\n<IMG>\nb"
    looped = "{% for p in messages[0]['content'] %}{{ p['type'] }};{% endfor %}"
    assert tok.decode(render_chat_ids(tok, messages, image_token="<IMG>",
                                      chat_template=looped)) == "text;image;image;text;"  # fmt: skip
    assert message_images(messages) == [("u1", "messages[0].content[1].image_url"),
                                        ("pil", "messages[0].content[2].image_pil")]  # fmt: skip
