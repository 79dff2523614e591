"""A tiny random-weight LLaVA for the tests: transformers' ``LlavaForConditionalGeneration``
(a CLIP vision tower, the projector, one of the tiny decoders) saved with the shared tokenizer
plus an ``<image>`` token, a LLaVA-style chat template and a CLIP image processor."""

from __future__ import annotations

import zlib
from pathlib import Path

from infer.testing.checkpoints import SEED, VOCAB_SIZE, _randomize, _tokenizer, build_once

VERSION = "v2"  # bump when the recipe changes: folders built before are not reused
IMAGE_SIZE = 56  # pixels a side: (56 / 14)^2 = 16 patches, 16 placeholder tokens an image
PATCH_SIZE = 14

# LLaVA 1.5's conversation shape: "USER: <image>\nWhat is this? ASSISTANT:" (an image part is
# written as its placeholder; the template loops over the content parts)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n' }}"
    "{% else %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


# LLaVA-NeXT's tiling resolutions for 56-pixel tiles (as llava-v1.6's are for 336)
PINPOINTS = [[56, 112], [112, 56], [112, 112], [56, 168], [168, 56]]


def build_llava(root: Path, text: str = "llama", strategy: str = "default",
                feature_layer: int | list[int] = -2, *, name: str | None = None,
                text_shape: dict | None = None, vision_shape: dict | None = None,
                next_: bool = False) -> Path:  # fmt: skip
    """The folder ``root/llava-<text>-<strategy>-<layers>-<VERSION>`` (or ``root/name``),
    built if absent: a LLaVA whose language model is a tiny ``text`` decoder (llama, mistral
    or qwen2); ``text_shape`` / ``vision_shape`` replace the tiny shapes' fields (a benchmark's
    larger model, under its own ``name``)."""
    layers = "_".join(str(i) for i in (feature_layer if isinstance(feature_layer, list)
                                       else [feature_layer]))  # fmt: skip
    kind = "llava-next" if next_ else "llava"
    final = Path(root) / (name or f"{kind}-{text}-{strategy}-{layers}-{VERSION}")
    if final.is_dir():
        return final

    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        MistralConfig,
        Qwen2Config,
    )

    Path(root).mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(_tokenizer(Path(root))), local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert image_id == VOCAB_SIZE, image_id
    eos = tokenizer.eos_token_id
    text_cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[text]
    text_config = text_cls(
        **{"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, **(text_shape or {})},
        max_position_embeddings=1024, vocab_size=VOCAB_SIZE + 8,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False,
    )  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
              "num_attention_heads": 4, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE,
              **(vision_shape or {})}  # fmt: skip
    vision_config = CLIPVisionConfig(projection_dim=16, **vision)
    size, patch = vision["image_size"], vision["patch_size"]
    common = dict(vision_config=vision_config, text_config=text_config,
                  image_token_index=image_id, vision_feature_select_strategy=strategy,
                  vision_feature_layer=feature_layer,
                  image_seq_length=(size // patch) ** 2 + (strategy == "full"))  # fmt: skip
    torch.manual_seed(SEED)
    square = {"size": {"shortest_edge": size}, "crop_size": {"height": size, "width": size}}
    if next_:
        config = LlavaNextConfig(image_grid_pinpoints=PINPOINTS, **common)
        model = LlavaNextForConditionalGeneration(config).to(torch.float32)
        processor = LlavaNextImageProcessor(image_grid_pinpoints=PINPOINTS, **square)
    else:
        model = LlavaForConditionalGeneration(LlavaConfig(**common)).to(torch.float32)
        processor = CLIPImageProcessor(**square)
    _randomize(model, SEED + zlib.crc32(final.name.encode()) % 10_000)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(tmp)

    return build_once(final, write)


def random_image(seed: int, size: tuple[int, int] = (70, 90)):
    """A random RGB PIL image (``size``: width, height), the same for the same seed."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)
