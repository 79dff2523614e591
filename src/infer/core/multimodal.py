"""A prompt's images, as the engine carries them (no torch: the scheduler and the KV manager
read only where they sit and what they are).

A vision-language model (LLaVA) reads an image as a run of placeholder tokens in the prompt,
one per feature its vision tower and projector make of it; the runner puts the features in
place of those tokens' embeddings::

    prompt ids : <s> USER : <img> <img> <img> <img> \\n What is this ? ASSISTANT :
    positions  : 0   1    2  3     4     5     6     7  ...
    image      :             [offset 3, length 4)  -> features 0..3 of that image

A chunk of the prompt (chunked prefill) may cut an image's run: each chunk takes the features
of the positions it covers (:func:`image_slices`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt: where its placeholder run starts (``offset``, a prompt index),
    how many tokens it is (``length``: the features the model makes of it), the digest of its
    pixels (what the prefix cache and the runner's features cache know it by: the same image
    sent twice is computed once) and the pixels as the model's processor made them
    (``pixel_values``: a float32 numpy array, ``ImageLayout.pixel_shape``)."""

    offset: int
    length: int
    digest: str
    pixel_values: Any
    size: tuple[int, int] | None = None  # (height, width) as sent: LLaVA-NeXT's tiling reads it

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ImageSlice:
    """A step's rows that take features of one image: rows ``row .. row + end - first`` of the
    flat batch get features ``first .. end`` of ``image``."""

    row: int
    image: ImageInput
    first: int
    end: int


def image_slices(
    images: tuple[ImageInput, ...], start: int, end: int, row: int
) -> list[ImageSlice]:
    """The parts of ``images`` that prompt positions ``start .. end`` cover, for a chunk whose
    first row in the step's batch is ``row``."""
    out = []
    for image in images:
        first, last = max(start, image.offset), min(end, image.end)
        if first < last:
            out.append(ImageSlice(row + first - start, image, first - image.offset,
                                  last - image.offset))  # fmt: skip
    return out


def block_image_keys(images: tuple[ImageInput, ...], start: int, end: int) -> tuple:
    """What a KV block over prompt positions ``start .. end`` depends on besides its tokens:
    the digest of each image whose placeholders it holds (the images before it are in its
    parent blocks' hashes already)."""
    return tuple(("image", im.digest) for im in images if im.offset < end and im.end > start)
