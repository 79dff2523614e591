"""Images in a vision-language model's prompts: read (a data URL, a web address, bytes, a PIL
image or an array), made pixels by the model's own image processor
(``preprocessor_config.json``, transformers' processor class), and put in the prompt as a run of
placeholder tokens, one per feature vector the model makes of the image.

A prompt names an image with one placeholder token (LLaVA's ``<image>``), which the chat
template writes for an image part and a plain prompt writes itself; :meth:`ImagePrompts.expand`
widens each to the image's run (ids with every run widened already are kept as they are)::

    ids      : 1  319  29901  <image>  13  1724 ...       one <image> per image
    expanded : 1  319  29901  <image> x N  13  1724 ...   N = the model's tokens per image
                              ^ ImageInput(offset 3, length N, digest, pixels)

The server and the offline ``LLM`` share this; the engine receives the expanded ids and the
:class:`~infer.core.multimodal.ImageInput` of each image.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer.core.multimodal import ImageInput
from infer.core.sampling_params import InvalidRequestError
from infer.model.spec import ModelSpec

# The most bytes an image may be (a data URL's decoded or a download's).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
# The most pixels an image may declare (a 6000 x 4000 photo is 24M): a small file can declare
# a huge image, which would take gigabytes to decode.
MAX_IMAGE_PIXELS = 40_000_000
# Seconds a web image may take to arrive, in all.
FETCH_TIMEOUT = 10.0
# The most images one prompt may hold (each is read, fetched and encoded).
MAX_IMAGES_PER_PROMPT = 16


@dataclass(frozen=True)
class Pixels:
    """An image as the model's processor made it: ``values`` float32 (``ImageLayout.
    pixel_shape``) and the image's ``size`` as sent (height, width: LLaVA-NeXT's tiling)."""

    values: Any
    size: tuple[int, int]


class ImagePrompts:
    """How a vision-language model's prompts take images: its processor, its placeholder
    token and how many of them an image is (``spec.images``), and the placeholder's text
    (``token``) for templates that write content as text."""

    def __init__(self, model_dir: Path, spec: ModelSpec, tokenizer: Any) -> None:
        assert spec.images is not None
        self.layout = spec.images
        self.token_id = spec.images.token_id
        self.token = tokenizer.convert_ids_to_tokens(self.token_id)
        if tokenizer.encode(self.token, add_special_tokens=False) != [self.token_id]:
            raise ValueError(f"the image token {self.token!r} ({self.token_id}) is not one token "
                             "of the tokenizer: prompts could not name their images")  # fmt: skip
        self.processor = _image_processor(Path(model_dir))
        layout = self.layout
        crop = getattr(self.processor, "crop_size", None) or {}
        side = crop.get("height") if isinstance(crop, dict) else getattr(crop, "height", None)
        if side is not None and side != layout.image_size:
            raise ValueError(f"the image processor crops to {side} pixels, the vision tower "
                             f"reads {layout.image_size}")  # fmt: skip
        pinpoints = getattr(self.processor, "image_grid_pinpoints", None)
        if layout.pinpoints and [list(p) for p in pinpoints or ()] != [list(p) for p in
                                                                         layout.pinpoints]:  # fmt: skip
            raise ValueError(f"the image processor tiles at {pinpoints}, the model at "
                             f"{[list(p) for p in layout.pinpoints]} (image_grid_pinpoints)")  # fmt: skip

    def _digest(self, p: Pixels) -> str:
        """An image's digest: its pixels', and LLaVA-NeXT's its size too (two sizes may make the
        same pixels and different runs)."""
        return image_digest(p.values, p.size if self.layout.pinpoints else None)

    def pixels(self, image: Any, param: str = "image", local_files: bool = False) -> Pixels:
        """One image (anything :func:`as_pil_image` reads) as the model's processor makes it."""
        pil = as_pil_image(image, param, local_files)
        try:
            out = self.processor(images=[pil], return_tensors="np")
        except Exception as e:  # noqa: BLE001 - the processor's own errors (odd modes, sizes)
            raise InvalidRequestError(f"{param}: the model's image processor cannot read it: "
                                      f"{e}", param=param) from None  # fmt: skip
        values = out["pixel_values"][0]
        sizes = out.get("image_sizes")
        size = (int(sizes[0][0]), int(sizes[0][1])) if sizes is not None else (pil.height,
                                                                              pil.width)  # fmt: skip
        want = self.layout.pixel_shape(size)
        if tuple(values.shape) != want:
            raise InvalidRequestError(f"{param}: the image processor made pixels of shape "
                                      f"{tuple(values.shape)}, the model reads {want}",
                                      param=param)  # fmt: skip
        return Pixels(values.astype("float32", copy=False), size)

    def expand(
        self, token_ids: list[int], images: list[Pixels], param: str = "prompt"
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """``token_ids`` with each image's placeholder widened to its run, and the images
        (:meth:`pixels`) as the engine takes them. The placeholders must match the images one
        to one, in order: one token each (``<image><image>``: two images), or each already
        its whole run."""
        lengths = [self.layout.tokens_for(p.size) for p in images]
        at_tokens = [i for i, t in enumerate(token_ids) if t == self.token_id]
        if len(at_tokens) == sum(lengths) and len(at_tokens) > len(images):  # (widened already)
            inputs, k = [], 0
            for n, p in zip(lengths, images, strict=True):
                start = at_tokens[k]
                if at_tokens[k + n - 1] != start + n - 1:
                    raise InvalidRequestError(f"the prompt's {len(at_tokens)} image "
                                              "placeholders are not one run per image",
                                              param=param)  # fmt: skip
                inputs.append(ImageInput(start, n, self._digest(p), p.values, p.size))
                k += n
            return list(token_ids), tuple(inputs)
        if len(at_tokens) != len(images):
            count = len(at_tokens)
            raise InvalidRequestError(
                f"the prompt has {count} image placeholder{'s' * (count != 1)} ({self.token}) "
                f"for {len(images)} image{'s' * (len(images) != 1)}: write one where each "
                "image goes",
                param=param,
            )
        out: list[int] = []
        inputs = []
        at = 0
        for start, n, p in zip(at_tokens, lengths, images, strict=True):
            out.extend(token_ids[at:start])
            inputs.append(ImageInput(len(out), n, self._digest(p), p.values, p.size))
            out.extend([self.token_id] * n)
            at = start + 1
        out.extend(token_ids[at:])
        return out, tuple(inputs)


def image_digest(pixels: Any, size: tuple[int, int] | None = None) -> str:
    """What the prefix cache and the runner's features cache know an image by: its pixels' and
    its size's (LLaVA-NeXT's vectors follow the size too: two sizes may resize alike)."""
    h = hashlib.sha256(f"{pixels.shape} {size}".encode())
    h.update(pixels.tobytes())
    return h.hexdigest()


def as_pil_image(image: Any, param: str = "image", local_files: bool = False) -> Any:
    """A PIL RGB image from a PIL image, a numpy ``[H, W, 3]`` uint8 array, raw file bytes, a
    ``data:image/...;base64,`` URL, an ``http(s)://`` address (fetched) or, with
    ``local_files`` (the offline API: never a server's client), a file path. Raises
    ``InvalidRequestError`` naming ``param``."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if hasattr(image, "__array_interface__"):
        try:
            return Image.fromarray(image).convert("RGB")
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"{param}: not an image array: {e}", param=param) from None
    if isinstance(image, str):
        image = _image_bytes(image, param, local_files)
    if not isinstance(image, bytes | bytearray):
        raise InvalidRequestError(f"{param}: an image is a PIL image, an array, bytes or a URL, "
                                  f"not {type(image).__name__}", param=param)  # fmt: skip
    try:
        with warnings.catch_warnings():  # (PIL's own bound warns; ours, below, refuses)
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            pil = Image.open(io.BytesIO(image))  # (reads the header: the size, not the pixels)
        width, height = pil.size
        if width * height > MAX_IMAGE_PIXELS:
            raise InvalidRequestError(f"{param}: a {width}x{height} image is more than "
                                      f"{MAX_IMAGE_PIXELS} pixels", param=param)  # fmt: skip
        pil.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise InvalidRequestError(f"{param}: not an image file PIL can read: {e}",
                                  param=param) from None  # fmt: skip
    return pil.convert("RGB")


def _image_bytes(url: str, param: str, local_files: bool) -> bytes:
    if url.startswith("data:"):
        head, comma, data = url.partition(",")
        if not comma or not head.endswith(";base64"):
            raise InvalidRequestError(f"{param}: a data URL must be data:<type>;base64,<data>",
                                      param=param)  # fmt: skip
        if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise InvalidRequestError(f"{param}: the image is more than {MAX_IMAGE_BYTES} "
                                      "bytes", param=param)  # fmt: skip
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError(f"{param}: the data URL is not valid base64",
                                      param=param) from None  # fmt: skip
    if url.startswith(("http://", "https://")):
        return fetch_image(url, param)
    if local_files:  # (the offline API: a file of the caller's)
        path = Path(url).expanduser()
        if path.is_file():
            return path.read_bytes()
    kinds = "a data:, http(s):// URL" + (" or a file" if local_files else "")
    raise InvalidRequestError(f"{param}: {url[:60]!r} is not {kinds}", param=param)


def fetch_image(url: str, param: str) -> bytes:
    """An image from the web, at most :data:`MAX_IMAGE_BYTES` (as sent: no compression
    undone), within :data:`FETCH_TIMEOUT` in all. Like vLLM, any address the server can reach
    is fetched (redirects followed): a server open to untrusted clients sits behind a proxy
    that limits where it may connect."""
    import time

    import httpx

    deadline = time.monotonic() + FETCH_TIMEOUT
    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT, follow_redirects=True,
                          headers={"Accept-Encoding": "identity"}) as r:  # fmt: skip
            if r.status_code != 200:
                raise InvalidRequestError(f"{param}: fetching {url} answered HTTP "
                                          f"{r.status_code}", param=param)  # fmt: skip
            data = bytearray()
            for part in r.iter_raw():
                data += part
                if len(data) > MAX_IMAGE_BYTES:
                    raise InvalidRequestError(f"{param}: {url} is more than {MAX_IMAGE_BYTES} "
                                              "bytes", param=param)  # fmt: skip
                if time.monotonic() > deadline:
                    raise InvalidRequestError(f"{param}: {url} took more than {FETCH_TIMEOUT:g} "
                                              "s to arrive", param=param)  # fmt: skip
            return bytes(data)
    except httpx.HTTPError as e:
        raise InvalidRequestError(f"{param}: cannot fetch {url}: {e}", param=param) from None


def _image_processor(model_dir: Path) -> Any:
    """The model's image processor (``preprocessor_config.json``), its numpy / PIL version
    (torchvision, which the default one needs, is not installed)."""
    from transformers import AutoImageProcessor

    if not (model_dir / "preprocessor_config.json").is_file():
        raise ValueError(f"{model_dir} has no preprocessor_config.json: a vision-language model "
                         "needs its image processor's settings")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoImageProcessor.from_pretrained(str(model_dir))
