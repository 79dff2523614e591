"""Sequence classifiers under tensor parallelism (its own module: the main TP module keeps a
two-rank engine open in a module-scoped fixture, and one process runs one TP engine at a time)."""

from __future__ import annotations

import pytest
import torch

from infer.llm import LLM

from .test_tensor_parallel import OPTIONS, PROMPTS

pytestmark = pytest.mark.distributed


def test_a_classifier_under_two_ranks_is_one_ranks(tiny_checkpoints, tmp_path, monkeypatch):
    """Every rank holds the whole score head (the final hidden states are whole on each): a
    classifier's logits, and a causal reranker's head made from rows of a vocabulary
    projection each rank holds a slice of, are one rank's."""
    from transformers import AutoTokenizer

    from infer.testing.checkpoints import build_classifier

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    qwen3 = tiny_checkpoints["qwen3"]
    tokens = AutoTokenizer.from_pretrained(qwen3).convert_ids_to_tokens([300, 301])
    reranker = {"architectures": ["Qwen3ForSequenceClassification"],
                "classifier_from_token": tokens, "is_original_qwen3_reranker": True}  # fmt: skip
    cases = [(str(build_classifier("qwen3", qwen3.parent, 3)), {}),
             (str(qwen3), {"hf_overrides": reranker})]  # fmt: skip
    for path, extra in cases:
        single = LLM(path, **OPTIONS, **extra).classify(PROMPTS)
        with LLM(path, tensor_parallel_size=2, **OPTIONS, **extra) as double:
            for one, two in zip(single, double.classify(PROMPTS), strict=True):
                torch.testing.assert_close(torch.tensor(two.outputs.logits),
                                           torch.tensor(one.outputs.logits), rtol=0, atol=1e-4)  # fmt: skip
            stats = double.engine.get_stats()
            assert stats.num_free_blocks == stats.num_total_blocks
