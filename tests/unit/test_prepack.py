"""oneDNN-packed linear weights: same numbers as ``F.linear``, applied only to CPU bfloat16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from infer.runner.prepack import PackedLinear, prepack_linears


class _Tiny(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32).to(dtype)
        self.proj = nn.Linear(32, 48, bias=True).to(dtype)
        self.back = nn.Linear(48, 32, bias=False).to(dtype)

    def vocab_projection_weight(self) -> torch.Tensor:
        return self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.back(torch.relu(self.proj(self.embed(ids))))
        packed = getattr(self, "packed_logits", None)
        return packed(h) if packed is not None else nn.functional.linear(h, self.embed.weight)


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@pytest.mark.skipif(not _available(), reason="torch built without oneDNN")
def test_packed_model_gives_the_same_logits():
    torch.manual_seed(0)
    model = _Tiny(torch.bfloat16)
    ids = torch.tensor([1, 7, 9, 44])
    with torch.inference_mode():
        want = model(ids)
        assert prepack_linears(model) == 3  # proj, back and the tied vocabulary projection
        assert isinstance(model.proj, PackedLinear) and isinstance(model.back, PackedLinear)
        got = model(ids)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_float32_and_switched_off_models_are_left_alone(monkeypatch):
    model = _Tiny(torch.float32)
    assert prepack_linears(model) == 0 and isinstance(model.proj, nn.Linear)
    monkeypatch.setenv("INFER_PREPACK_WEIGHTS", "0")
    model = _Tiny(torch.bfloat16)
    assert prepack_linears(model) == 0 and isinstance(model.proj, nn.Linear)
