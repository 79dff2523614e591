"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector and one
of our decoders (Llama, Mistral, Qwen 2).

An image becomes ``num_image_tokens`` vectors in the decoder's embedding space::

    pixels [3, S, S] ─ patch conv (S/p)^2 patches ─ + CLS ─ + positions ─ pre-LN
        ─ CLIP layers ... up to vision_feature_layer ─ (drop CLS: "default")
        ─ linear_1 ─ gelu ─ linear_2 ─> [num_image_tokens, text hidden]

which take the place of the image's placeholder tokens in the prompt (``image_token_index``,
expanded to one per vector by the server or ``LLM``: model/images.py). From there the decoder
runs as it does for text: the KV cache, prefix caching (keyed by the image's digest), chunked
prefill, batching are the text model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infer.model.layers import WeightSource
from infer.model.llama import DecoderConfig, DecoderLM
from infer.model.spec import ImageLayout

ARCHITECTURE = "LlavaForConditionalGeneration"
NEXT_ARCHITECTURE = "LlavaNextForConditionalGeneration"

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class VisionConfig:
    """A CLIP vision tower's shape (``vision_config``, with transformers' defaults filled in)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class LlavaConfig:
    """The decoder's config, the vision tower's, and how the two meet: which of the tower's
    hidden states are read (``feature_layers``: indices into transformers' ``hidden_states``,
    several concatenated), whether the CLS vector is dropped (``drop_cls``: the ``default``
    strategy), the projector's activation and bias, and the placeholder token."""

    text: DecoderConfig
    vision: VisionConfig
    feature_layers: tuple[int, ...]
    drop_cls: bool
    projector_act: str
    projector_bias: bool
    image_token_id: int
    # LLaVA-NeXT's tiling resolutions, (height, width) each (empty: LLaVA's one tile)
    pinpoints: tuple[tuple[int, int], ...] = ()

    # The fields the engine reads of any parsed config (ModelSpec), the decoder's.
    num_layers = property(lambda self: self.text.num_layers)
    num_heads = property(lambda self: self.text.num_heads)
    num_kv_heads = property(lambda self: self.text.num_kv_heads)
    head_dim = property(lambda self: self.text.head_dim)
    hidden_size = property(lambda self: self.text.hidden_size)
    vocab_size = property(lambda self: self.text.vocab_size)
    max_position_embeddings = property(lambda self: self.text.max_position_embeddings)

    @property
    def layout(self) -> ImageLayout:
        v = self.vision
        return ImageLayout(self.image_token_id, v.image_size, v.patch_size, v.num_channels,
                           not self.drop_cls, self.pinpoints)  # fmt: skip


def _with_defaults(sub: dict[str, Any], what: str) -> dict[str, Any]:
    """A sub-config as transformers reads it: hub LLaVA configs write only the fields that
    differ from the family's defaults (``llava-1.5-7b-hf``'s ``text_config`` names no layer
    count)."""
    from transformers import AutoConfig

    model_type = sub.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f"{what} has no model_type")
    fields = {k: v for k, v in sub.items() if k != "model_type"}
    try:
        full = AutoConfig.for_model(model_type, **fields).to_dict()
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    return {**full, **sub}


def parse_vision_config(config: dict[str, Any]) -> VisionConfig:
    if config.get("model_type") not in ("clip_vision_model", "clip"):
        raise ValueError(f"vision_config.model_type {config.get('model_type')!r}: only a CLIP "
                         "vision tower (clip_vision_model) is supported")  # fmt: skip
    if config.get("model_type") == "clip":
        config = config.get("vision_config") or {}
    full = _with_defaults({"model_type": "clip_vision_model", **config}, "vision_config")
    act = full.get("hidden_act", "quick_gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"vision_config.hidden_act {act!r} is not supported")
    return VisionConfig(
        hidden_size=int(full["hidden_size"]),
        intermediate_size=int(full["intermediate_size"]),
        num_layers=int(full["num_hidden_layers"]),
        num_heads=int(full["num_attention_heads"]),
        image_size=int(full["image_size"]),
        patch_size=int(full["patch_size"]),
        num_channels=int(full.get("num_channels", 3)),
        layer_norm_eps=float(full.get("layer_norm_eps", 1e-5)),
        hidden_act=act,
    )


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """``x``: ``[N * L, D]`` rows of N images of L vectors each."""
        n, length = shape
        heads = self.num_heads

        def split(t: torch.Tensor) -> torch.Tensor:  # [N*L, D] -> [N, heads, L, D/heads]
            return t.view(n, length, heads, -1).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)  # every vector sees the whole image
        return self.out_proj(out.transpose(1, 2).reshape(n * length, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    """A CLIP encoder layer: pre-norm attention and MLP, each with its residual."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), shape)
        return x + self.mlp(self.layer_norm2(x))


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size,
                                         stride=cfg.patch_size, bias=False)  # fmt: skip
        self.position_embedding = nn.Embedding(cfg.num_patches + 1, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` -> ``[N, 1 + patches, D]``: CLS first, then the patches row by row."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(len(pixels), 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class VisionTower(nn.Module):
    """CLIP's vision transformer, run up to the deepest layer LLaVA reads."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(cfg.num_layers))
        # (read by no LLaVA: kept so that the checkpoint's tensors all have a place)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, layers: tuple[int, ...]) -> list[torch.Tensor]:
        """The hidden states ``layers`` index (transformers' ``hidden_states``: 0 the
        embeddings after the pre-norm, i the output of layer i; negative from the end), each
        ``[N, 1 + patches, D]``."""
        count = len(self.layers) + 1
        wanted = [i % count for i in layers]
        x = self.pre_layrnorm(self.embeddings(pixels))
        n, length, width = x.shape
        states = {0: x} if 0 in wanted else {}  # (only the states read: memory)
        h = x.reshape(n * length, width)
        for i, layer in enumerate(self.layers[: max(wanted)], start=1):
            h = layer(h, (n, length))
            if i in wanted:
                states[i] = h.view(n, length, width)
        return [states[i] for i in wanted]


class Projector(nn.Module):
    """``multi_modal_projector``: vision width -> text width, two linears and an activation."""

    def __init__(self, vision_width: int, text_width: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, text_width, bias=bias)
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaMixin:
    """What a decoder family gains as LLaVA's language model (:func:`llava_class` puts it in
    front of the family's class): the vision tower, the projector, and ``embed_images``."""

    # Ours are the decoder's names (model.*, lm_head.*) and CLIP's (vision_tower.vision_model.*);
    # checkpoints nest them as transformers 4 (language_model.model.*) or 5 does.
    checkpoint_aliases = (
        ("model.", "language_model.model."),
        ("model.", "model.language_model."),
        ("lm_head.", "language_model.lm_head."),
        ("vision_tower.vision_model.", "vision_tower."),
        ("vision_tower.vision_model.", "model.vision_tower.vision_model."),
        ("vision_tower.vision_model.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("image_newline", "model.image_newline"),
    )
    llava: LlavaConfig

    def _build_vision(self, cfg: LlavaConfig) -> None:
        self.llava = cfg
        self.vision_tower = VisionTower(cfg.vision)
        width = cfg.vision.hidden_size * len(cfg.feature_layers)
        self.multi_modal_projector = Projector(width, cfg.text.hidden_size, cfg.projector_act,
                                               cfg.projector_bias)  # fmt: skip
        # LLaVA-NeXT: the vector that ends each row of an image's tiles
        self.image_newline = (nn.Parameter(torch.empty(cfg.text.hidden_size))
                              if cfg.pinpoints else None)  # fmt: skip

    def embed_tiles(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` float pixels (tiles) -> ``[N, vectors per tile, text hidden]``."""
        states = self.vision_tower(pixels, self.llava.feature_layers)
        if self.llava.drop_cls:
            states = [s[:, 1:] for s in states]
        features = torch.cat(states, dim=-1)
        n, length, width = features.shape
        out = self.multi_modal_projector(features.reshape(n * length, width))
        return out.view(n, length, -1)

    def embed_images(self, pixels: list[torch.Tensor],
                     sizes: list[tuple[int, int] | None]) -> list[torch.Tensor]:  # fmt: skip
        """Each image's vectors ``[tokens, text hidden]``, in its placeholders' order, from
        its pixels (``[C, S, S]``; LLaVA-NeXT's ``[1 + tiles, C, S, S]``) and its size as sent
        (height, width: LLaVA-NeXT's layout); the images' tiles run through the tower
        together."""
        tiles = [p if p.dim() == 4 else p[None] for p in pixels]
        vectors = self.embed_tiles(torch.cat(tiles)).split([len(t) for t in tiles])
        if not self.llava.pinpoints:
            return [v[0] for v in vectors]
        return [self._pack(v, size) for v, size in zip(vectors, sizes, strict=True)]

    def _pack(self, vectors: torch.Tensor, size: tuple[int, int] | None) -> torch.Tensor:
        """LLaVA-NeXT: the whole image's vectors, then its tiles' as one grid (tile rows and
        columns side by side), its padding cut away, a newline vector after each row::

            tiles [r*c, s*s, H] -> grid [H, r*s, c*s] -> unpadded [H, h, w]
                                -> + newline column [H, h, w+1] -> rows [h*(w+1), H]
        """
        assert size is not None and self.image_newline is not None
        layout = self.llava.layout
        rows, columns = layout.grid(size)
        side = layout.side
        base, tiles = vectors[0], vectors[1:]
        if layout.cls:  # (the tiles' grid is of patches: a kept CLS vector has no place in it)
            raise ValueError("LLaVA-NeXT with the full feature selection is not supported")
        grid = tiles.view(rows, columns, side, side, -1).permute(4, 0, 2, 1, 3)
        grid = grid.reshape(-1, rows * side, columns * side)
        height, width = layout.unpadded(size)
        top = (rows * side - height) // 2
        left = (columns * side - width) // 2
        grid = grid[:, top : top + height, left : left + width]
        newline = self.image_newline[:, None, None].expand(-1, height, 1).to(grid.dtype)
        grid = torch.cat([grid, newline], dim=-1)
        return torch.cat([base, grid.flatten(1, 2).transpose(0, 1)])

    def vision_sources(self) -> dict[str, WeightSource]:
        src = {}
        if self.image_newline is not None:
            src["image_newline"] = WeightSource(("image_newline",))
        for name, _ in self.vision_tower.named_parameters():
            src[f"vision_tower.{name}"] = WeightSource((_vision_name(name),))
        for name, _ in self.multi_modal_projector.named_parameters():
            src[f"multi_modal_projector.{name}"] = WeightSource((f"multi_modal_projector.{name}",))
        return src


def _vision_name(ours: str) -> str:
    """Our vision tower's parameter -> transformers' CLIP name (its encoder's layers)."""
    if ours.startswith("layers."):
        ours = "encoder." + ours
    return f"vision_tower.vision_model.{ours}"


def parse_llava_config(config: dict[str, Any], parse_text, next_: bool = False) -> LlavaConfig:
    text_raw = config.get("text_config")
    vision_raw = config.get("vision_config")
    if not isinstance(text_raw, dict) or not isinstance(vision_raw, dict):
        raise ValueError("a LLaVA config needs text_config and vision_config objects")
    text = parse_text(_with_defaults(text_raw, "text_config"))
    vision = parse_vision_config(vision_raw)
    layers = config.get("vision_feature_layer", -2)
    layers = tuple(int(i) for i in (layers if isinstance(layers, list) else [layers]))
    if not layers or any(not -vision.num_layers - 1 <= i <= vision.num_layers for i in layers):
        raise ValueError(f"vision_feature_layer {config.get('vision_feature_layer')!r} is not a "
                         f"layer of the {vision.num_layers}-layer vision tower")  # fmt: skip
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r}: default or full")
    image_token = config.get("image_token_index", config.get("image_token_id"))
    if not isinstance(image_token, int) or not 0 <= image_token < text.vocab_size:
        raise ValueError(f"image_token_index {image_token!r} is not a token of the "
                         f"{text.vocab_size}-token vocabulary")  # fmt: skip
    act = config.get("projector_hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"projector_hidden_act {act!r} is not supported")
    if vision.image_size % vision.patch_size:
        raise ValueError("vision_config.image_size is not a multiple of its patch_size")
    pinpoints: tuple[tuple[int, int], ...] = ()
    if next_:
        raw = config.get("image_grid_pinpoints")
        if (not isinstance(raw, list) or not raw
                or any(not isinstance(p, list | tuple) or len(p) != 2 for p in raw)):  # fmt: skip
            raise ValueError("image_grid_pinpoints must be a list of [height, width] pairs")
        pinpoints = tuple((int(h), int(w)) for h, w in raw)
        if any(h % vision.image_size or w % vision.image_size for h, w in pinpoints):
            raise ValueError(f"image_grid_pinpoints {raw} are not multiples of the vision "
                             f"tower's {vision.image_size} pixels")  # fmt: skip
        if strategy != "default":
            raise ValueError("LLaVA-NeXT with vision_feature_select_strategy full is not "
                             "supported (its tiles' grid is of patches)")  # fmt: skip
    return LlavaConfig(text, vision, layers, strategy == "default", act,
                       bool(config.get("multimodal_projector_bias", True)), image_token,
                       pinpoints)  # fmt: skip


def llava_class(text_cls: type[DecoderLM], next_: bool = False) -> type[DecoderLM]:
    """LLaVA (``next_``: LLaVA-NeXT) over the decoder family ``text_cls`` (its
    ``text_config``'s)."""

    class Llava(LlavaMixin, text_cls):  # type: ignore[misc, valid-type]
        __doc__ = f"LLaVA with {text_cls.__name__} as its language model."
        architecture = NEXT_ARCHITECTURE if next_ else ARCHITECTURE

        def __init__(self, cfg: LlavaConfig) -> None:
            text_cls.__init__(self, cfg.text)
            self._build_vision(cfg)

        @classmethod
        def parse_config(cls, config: dict[str, Any]) -> LlavaConfig:  # type: ignore[override]
            return parse_llava_config(config, text_cls.parse_config, next_)

        def weight_sources(self) -> dict[str, WeightSource]:
            return {**text_cls.weight_sources(self), **self.vision_sources()}

    family = text_cls.__name__.removesuffix("ForCausalLM")
    Llava.__name__ = Llava.__qualname__ = f"Llava{'Next' if next_ else ''}{family}"
    return Llava
