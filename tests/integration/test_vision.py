"""LLaVA (a vision-language model) offline: ``LLM.generate`` with ``multi_modal_data`` and
``LLM.chat`` with image parts give transformers' greedy tokens token for token, for one image
or several per prompt, prompts with different images batched together, prompts cut into
chunks through an image's placeholders, and through the prefix cache (the same text with
another image is not served the first image's KV; the same image again is). Bad images and
placeholders that do not match the images are refused naming the problem; every KV block comes
back (the ``make_llm`` fixture checks)."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from infer import SamplingParams
from infer.core.sampling_params import InvalidRequestError
from infer.testing.checkpoints import default_root
from infer.testing.vision import build_llava, random_image

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: <image>\nand <image>\nhow do they differ? ASSISTANT:"

# (decoder family, feature selection, vision layers read): transformers' defaults, the CLS
# vector kept from the last layer, two layers concatenated
VARIANTS = [("llama", "default", -2), ("mistral", "full", -1), ("qwen2", "default", [-3, -1])]


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: f"{v[0]}-{v[1]}")
def llava(request):
    text, strategy, layers = request.param
    return build_llava(default_root(), text, strategy, layers)


@pytest.fixture(scope="module")
def llava_llama():
    return build_llava(default_root())


_HF: dict[str, object] = {}


def hf_greedy(folder, ids: list[int], pixels: list, num_tokens: int = 10) -> list[int]:
    """transformers' greedy continuation of expanded prompt ids with these images' pixels
    (LLaVA-NeXT's: each image's tiles padded to the most any has, with the images' sizes)."""
    from transformers import AutoModelForImageTextToText

    key = str(folder)
    if key not in _HF:
        _HF[key] = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    model = _HF[key]
    images = {}
    if pixels and pixels[0].values.ndim == 4:  # (LLaVA-NeXT)
        most = max(len(p.values) for p in pixels)
        padded = torch.zeros(len(pixels), most, *pixels[0].values.shape[1:])
        for k, p in enumerate(pixels):
            padded[k, : len(p.values)] = torch.from_numpy(p.values)
        images = {"pixel_values": padded, "image_sizes": torch.tensor([p.size for p in pixels])}
    elif pixels:
        images = {"pixel_values": torch.stack([torch.from_numpy(p.values) for p in pixels])}
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), **images,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=num_tokens, do_sample=False, eos_token_id=None)  # fmt: skip
    return out[0, len(ids) :].tolist()


def pixels_of(llm, images) -> list:
    return [llm.engine.image_prompts.pixels(im) for im in images]


def test_generate_with_images_matches_transformers(make_llm, llava):
    llm = make_llm(str(llava), max_num_seqs=4)
    a, b, c = random_image(1), random_image(2, (40, 120)), random_image(3)
    prompts = [
        {"prompt": ONE, "multi_modal_data": {"image": a}},
        {"prompt": ONE, "multi_modal_data": {"image": [b]}},
        {"prompt": TWO, "multi_modal_data": {"image": [c, a]}},
        "USER: no picture here ASSISTANT:",
    ]
    results = llm.generate(prompts, GREEDY)
    layout = llm.engine.spec.images
    for result, images in zip(results, [[a], [b], [c, a], []], strict=True):
        ids = result.prompt_token_ids
        assert ids.count(layout.token_id) == layout.base_tokens * len(images)
        assert result.outputs[0].token_ids == hf_greedy(llava, ids, pixels_of(llm, images))
    # the image decides the reply: the same words about two images differ
    assert results[0].outputs[0].token_ids != results[1].outputs[0].token_ids
    assert results[0].prompt == ONE


def test_chunks_cut_through_an_image(make_llm, llava_llama):
    """Chunks of 5 tokens (an image is 16): each chunk takes its share of the image's features,
    its features computed once."""
    llm = make_llm(str(llava_llama), prefill_chunk_size=5, max_num_batched_tokens=8)
    a, b = random_image(4), random_image(5)
    out = llm.generate({"prompt": TWO, "multi_modal_data": {"image": [a, b]}}, GREEDY)[0]
    assert out.outputs[0].token_ids == hf_greedy(llava_llama, out.prompt_token_ids,
                                                 pixels_of(llm, [a, b]))  # fmt: skip


def test_prefix_cache_keys_blocks_by_image(make_llm, llava_llama):
    llm = make_llm(str(llava_llama), enable_prefix_caching=True, block_size=4)
    a, b = random_image(6), random_image(7)
    text = "A long shared system prompt comes first. USER: <image>\nDescribe it. ASSISTANT:"
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": a}}, GREEDY)[0]
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": b}}, GREEDY)[0]
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": a}}, GREEDY)[0]
    start = first.prompt_token_ids.index(llm.engine.spec.images.token_id)
    # the other image: only the blocks before its first placeholder are shared
    assert other.num_cached_tokens == start // 4 * 4
    assert other.outputs[0].token_ids == hf_greedy(llava_llama, other.prompt_token_ids,
                                                   pixels_of(llm, [b]))  # fmt: skip
    # the same image: everything but the last block of the prompt
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 4 * 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_preempted_requests_recompute_their_images(make_llm, llava_llama):
    """A KV cache too small for every prompt at once: requests are preempted and run again,
    their images' features included."""
    llm = make_llm(str(llava_llama), num_kv_blocks=12, block_size=8, max_num_seqs=4,
                   enable_prefix_caching=False)  # fmt: skip
    images = [random_image(10 + i) for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    results = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": im}} for im in images],
                           params)  # fmt: skip
    for result, image in zip(results, images, strict=True):
        assert result.outputs[0].token_ids == hf_greedy(llava_llama, result.prompt_token_ids,
                                                        pixels_of(llm, [image]), 24)  # fmt: skip
    assert llm.engine.get_stats().num_preemptions_total > 0


def test_chat_with_an_image_url(make_llm, llava_llama):
    llm = make_llm(str(llava_llama))
    image = random_image(8)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Look:"},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is it?"},
    ]}]  # fmt: skip
    out = llm.chat(messages, GREEDY)
    expected_text = "USER: Look:<image>\nWhat is it?\nASSISTANT:"
    direct = llm.generate({"prompt": expected_text, "multi_modal_data": {"image": image}},
                          GREEDY)[0]  # fmt: skip
    assert out.prompt_token_ids == direct.prompt_token_ids
    assert out.outputs[0].token_ids == hf_greedy(llava_llama, out.prompt_token_ids,
                                                 pixels_of(llm, [image]))  # fmt: skip


def test_bad_images_and_placeholders_are_refused(make_llm, llava_llama, tiny_checkpoints):
    llm = make_llm(str(llava_llama))
    a = random_image(9)
    cases = [
        ({"prompt": ONE, "multi_modal_data": {"image": [a, a]}}, "1 image placeholder (<image>) "
         "for 2 images"),
        ({"prompt": ONE}, "every placeholder needs its image"),
        ({"prompt": "no placeholder", "multi_modal_data": {"image": a}}, "0 image placeholders"),
        ({"prompt": ONE, "multi_modal_data": {"image": b"not a png"}}, "not an image file"),
        ({"prompt": ONE, "multi_modal_data": {"image": "data:image/png;base64,!!"}},
         "not valid base64"),
        ({"prompt": ONE, "multi_modal_data": {"audio": a}}, "takes images ('image'), not audio"),
    ]  # fmt: skip
    bomb = _png_header(10_000, 10_000)  # (a 70-byte file declaring 100M pixels)
    cases.append(({"prompt": ONE, "multi_modal_data": {"image": bomb}}, "is more than 40000000 "
                  "pixels"))  # fmt: skip
    for prompt, message in cases:
        with pytest.raises(
            InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")
        ):
            llm.generate(prompt, GREEDY)
    # the engine goes on serving
    ok = llm.generate({"prompt": ONE, "multi_modal_data": {"image": a}}, GREEDY)[0]
    assert len(ok.outputs[0].token_ids) == 10
    bad_part = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "image_url", "image_url": {"url": "data:,"}}]}]  # fmt: skip
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content\[1\]\.image_url"):
        llm.chat(bad_part, GREEDY)
    text_only = make_llm("llama")
    with pytest.raises(InvalidRequestError, match="reads no images"):
        text_only.generate({"prompt": "x", "multi_modal_data": {"image": a}}, GREEDY)
    with pytest.raises(InvalidRequestError, match="reads no images"):
        text_only.chat([{"role": "user", "content": [{"type": "image_url",
                                                      "image_url": {"url": "data:,"}}]}])  # fmt: skip


def _png_header(width: int, height: int) -> bytes:
    """A PNG declaring an RGB image of that size whose pixel data is a few bytes (PIL reads
    the size from its header)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))  # fmt: skip


def test_adjacent_and_widened_placeholders(make_llm, llava_llama):
    """``<image><image>`` is two images; ids whose every run is widened already are kept."""
    llm = make_llm(str(llava_llama))
    a, b = random_image(11), random_image(12)
    two = llm.generate({"prompt": "USER: <image><image> ASSISTANT:",
                        "multi_modal_data": {"image": [a, b]}}, GREEDY)[0]  # fmt: skip
    assert two.outputs[0].token_ids == hf_greedy(llava_llama, two.prompt_token_ids,
                                                 pixels_of(llm, [a, b]))  # fmt: skip
    again = llm.generate({"prompt_token_ids": two.prompt_token_ids,
                          "multi_modal_data": {"image": [a, b]}}, GREEDY)[0]  # fmt: skip
    assert again.prompt_token_ids == two.prompt_token_ids
    assert again.outputs[0].token_ids == two.outputs[0].token_ids


@pytest.mark.parametrize("text", ["llama", "mistral"])
def test_llava_next_tiles_match_transformers(make_llm, text):
    """LLaVA-NeXT: an image is tiled at the resolution that fits it best, its tiles' vectors
    unpadded to its aspect ratio with a newline vector after each row, so its placeholder run
    depends on its size: wide, tall and square images, one or two a prompt, chunked through
    the runs, give transformers' tokens."""
    folder = build_llava(default_root(), text, next_=True)
    llm = make_llm(str(folder), prefill_chunk_size=24, max_num_batched_tokens=32)
    sizes = [(70, 90), (200, 60), (56, 56), (300, 120), (40, 160)]  # (width, height)
    images = [random_image(60 + i, size) for i, size in enumerate(sizes)]
    prompts = [{"prompt": ONE, "multi_modal_data": {"image": im}} for im in images]
    prompts.append({"prompt": TWO, "multi_modal_data": {"image": images[:2]}})
    results = llm.generate(prompts, GREEDY)
    lengths = set()
    for result, ims in zip(results, [[im] for im in images] + [images[:2]], strict=True):
        pixels = pixels_of(llm, ims)
        lengths.update(llm.engine.spec.images.tokens_for(p.size) for p in pixels)
        assert result.outputs[0].token_ids == hf_greedy(folder, result.prompt_token_ids, pixels)
    assert len(lengths) >= 4  # (the runs' lengths follow the images' shapes)


def test_llava_next_same_pixels_other_size_is_another_image(make_llm):
    """Two sizes can make the same pixels (a solid 20x240 and 20x241 image) and different runs
    (52 and 28 tokens: one keeps no column of tiles once unpadded): the prefix cache and the
    features cache tell them apart by the size too."""
    from PIL import Image

    folder = build_llava(default_root(), next_=True)
    llm = make_llm(str(folder), enable_prefix_caching=True, block_size=4)
    images = [Image.new("RGB", (20, height), (120, 30, 200)) for height in (240, 241)]
    pixels = pixels_of(llm, images)
    assert (pixels[0].values == pixels[1].values).all()
    for image, p in zip(images, pixels, strict=True):  # (one after another: the cache is warm)
        out = llm.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, GREEDY)[0]
        assert out.outputs[0].token_ids == hf_greedy(folder, out.prompt_token_ids, [p])
    assert [llm.engine.spec.images.tokens_for(p.size) for p in pixels] == [52, 28]
