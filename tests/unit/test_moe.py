"""The expert layer (model/moe.py) against transformers' own sparse blocks, on the routing edge
cases: ties in the router's scores, every row sent to one expert, a batch of one, top-k equal
to the number of experts; the C++ layer (csrc/moe.cpp, CPU bf16) against the torch code on the
same cases; plus the config parsing (which layers are sparse, bad fields named)."""

from __future__ import annotations

import pytest
import torch

from infer.model.llama import MixtralForCausalLM
from infer.model.moe import SparseMoE, parse_moe, route
from infer.model.qwen import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

HIDDEN, WIDTH, SHARED_WIDTH = 64, 32, 64


def _hf_block(arch: str, num_experts: int, top_k: int, norm_topk_prob: bool = False):
    """transformers' sparse block of ``arch`` with seeded random weights, float32."""
    import transformers

    common = dict(hidden_size=HIDDEN, num_attention_heads=4, num_hidden_layers=1,
                  num_experts_per_tok=top_k)  # fmt: skip
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=WIDTH,
                                         num_local_experts=num_experts)  # fmt: skip
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg)
    elif arch == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            **common, moe_intermediate_size=WIDTH, num_experts=num_experts,
            shared_expert_intermediate_size=SHARED_WIDTH, norm_topk_prob=norm_topk_prob,
        )  # fmt: skip
        block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=WIDTH,
                                          num_experts=num_experts, norm_topk_prob=norm_topk_prob)  # fmt: skip
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    cfg._experts_implementation = "eager"  # transformers' reference loop (no model sets it)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return block.float().eval()


def _ours(arch: str, hf) -> SparseMoE:
    """Our layer holding ``hf``'s weights (transformers fuses gate and up as we do)."""
    moe = parse_moe(
        {"num_experts": hf.experts.num_experts, "num_experts_per_tok": hf.gate.top_k,
         "moe_intermediate_size": WIDTH, "shared_expert_intermediate_size": SHARED_WIDTH,
         "norm_topk_prob": getattr(hf.gate, "norm_topk_prob", True)},
        1, experts_fields=("num_experts",), width_field="moe_intermediate_size",
        float32_weights=arch == "mixtral", shared_expert=arch == "qwen2_moe",
    )  # fmt: skip
    ours = SparseMoE(HIDDEN, moe, "silu")
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(hf.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(hf.experts.down_proj[e])
        if ours.shared_expert is not None:
            sh = hf.shared_expert
            ours.shared_expert.gate_up_proj.weight.copy_(
                torch.cat([sh.gate_proj.weight, sh.up_proj.weight])
            )
            ours.shared_expert.down_proj.weight.copy_(sh.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    return ours.eval()


def _compare(hf, ours: SparseMoE, x: torch.Tensor) -> dict[int, list[int]]:
    """Our layer against transformers' block on ``x``; returns how many rows each expert ran
    on in our forward pass (one entry per call)."""
    calls: dict[int, list[int]] = {}
    hooks = [
        expert.register_forward_hook(
            lambda _m, args, _out, e=e: calls.setdefault(e, []).append(args[0].shape[0])
        )
        for e, expert in enumerate(ours.experts)
    ]
    with torch.no_grad():
        _, hf_weights, hf_experts = hf.gate(x)
        want_routed = hf.experts(x, hf_experts, hf_weights)
        weights, experts = route(ours.router(x), ours.top_k, ours.norm_topk_prob)
        if not ours.float32_weights:
            weights = weights.to(x.dtype)
        got_routed = ours.experts_forward(x, weights, experts)
        calls.clear()
        want, got = hf(x.unsqueeze(0))[0], ours(x)
    for hook in hooks:
        hook.remove()
    # Same rows, in the same order, through the same matmuls, summed in the same order: the
    # same bits.
    assert torch.equal(experts, hf_experts)
    assert torch.equal(got_routed, want_routed), (got_routed - want_routed).abs().max()
    # The shared expert's gate and up are one matmul here, two there: float32 rounding.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    return calls


ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.mark.parametrize(
    ("arch", "norm"),
    [("mixtral", True), ("qwen2_moe", False), ("qwen2_moe", True), ("qwen3_moe", False),
     ("qwen3_moe", True)],
)  # fmt: skip
def test_matches_transformers_block(arch, norm):
    hf = _hf_block(arch, num_experts=8, top_k=3, norm_topk_prob=norm)
    ours = _ours(arch, hf)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    calls = _compare(hf, ours, x)
    assert all(len(c) == 1 for c in calls.values()), "an expert ran twice in one step"
    assert sum(sum(c) for c in calls.values()) == 37 * 3


@pytest.mark.parametrize("arch", ARCHS)
def test_ties_in_router_scores_break_as_transformers_does(arch):
    hf = _hf_block(arch, num_experts=8, top_k=2)
    with torch.no_grad():
        hf.gate.weight[1::2] = 0  # experts 1, 3, 5, 7 always score 0: tied with each other
        hf.gate.weight[4] = hf.gate.weight[2]  # experts 2 and 4 always tie
        hf.gate.weight[6] = hf.gate.weight[0] = 0  # ...and 0, 6 tie with the zeros
    ours = _ours(arch, hf)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(24, HIDDEN, generator=gen)
    x[:6] = 0  # every expert scores 0: an eight-way tie
    with torch.no_grad():
        _, want_weights, want_experts = hf.gate(x)
        weights, experts = route(ours.router(x), ours.top_k, ours.norm_topk_prob)
    assert torch.equal(experts, want_experts)
    assert torch.allclose(weights.to(want_weights.dtype), want_weights)
    _compare(hf, ours, x)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_expert_takes_every_row_and_idle_experts_cost_nothing(arch):
    hf = _hf_block(arch, num_experts=8, top_k=1)
    with torch.no_grad():
        hf.gate.weight.zero_()
        hf.gate.weight[5, 0] = 50.0  # expert 5 wins wherever x[:, 0] > 0
    ours = _ours(arch, hf)
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(3))
    x[:, 0] = x[:, 0].abs() + 1
    calls = _compare(hf, ours, x)
    assert calls == {5: [16]}


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_one_runs_only_its_k_experts(arch):
    hf = _hf_block(arch, num_experts=8, top_k=2)
    ours = _ours(arch, hf)
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(4))
    calls = _compare(hf, ours, x)
    assert len(calls) == 2 and all(c == [1] for c in calls.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_top_k_equal_to_the_number_of_experts(arch):
    hf = _hf_block(arch, num_experts=4, top_k=4, norm_topk_prob=True)
    ours = _ours(arch, hf)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(5))
    calls = _compare(hf, ours, x)
    assert calls == {e: [9] for e in range(4)}
    weights, _ = route(ours.router(x), 4, True)
    assert torch.allclose(weights.sum(-1), torch.ones(9))


def test_bfloat16_matches_transformers_block_to_rounding():
    for arch in ARCHS:
        hf = _hf_block(arch, num_experts=8, top_k=2)
        ours = _ours(arch, hf)
        hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
        x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(6)).bfloat16()
        with torch.no_grad():
            want, got = hf(x.unsqueeze(0))[0].float(), ours(x).float()
        # The fused act(gate) * up kernel rounds within one bf16 step of torch's ops.
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), arch


def test_empty_step():
    hf = _hf_block("qwen2_moe", num_experts=4, top_k=2)
    out = _ours("qwen2_moe", hf)(torch.zeros(0, HIDDEN))
    assert out.shape == (0, HIDDEN)


def _qwen2_moe_config(**overrides) -> dict:
    cfg = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        vocab_size=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )  # fmt: skip
    cfg.update(overrides)
    return cfg


def test_dense_layers_from_mlp_only_layers_and_decoder_sparse_step():
    cfg = Qwen2MoeForCausalLM.parse_config(_qwen2_moe_config(mlp_only_layers=[1]))
    assert cfg.moe is not None
    assert cfg.moe.sparse_layers == (True, False, True, True, True, True)
    cfg = Qwen2MoeForCausalLM.parse_config(
        _qwen2_moe_config(decoder_sparse_step=2, mlp_only_layers=[3])
    )
    assert cfg.moe is not None
    assert cfg.moe.sparse_layers == (False, True, False, False, False, True)
    assert cfg.moe.shared_expert_intermediate_size == 48 and not cfg.moe.norm_topk_prob
    assert cfg.qkv_bias  # Qwen2-MoE's q/k/v biases, as in Qwen 2


def test_each_architecture_reads_its_own_fields():
    mixtral = MixtralForCausalLM.parse_config(
        _qwen2_moe_config(num_experts=None, num_local_experts=4, intermediate_size=32)
    )
    assert mixtral.moe is not None and mixtral.moe.num_experts == 4
    assert mixtral.moe.norm_topk_prob and mixtral.moe.float32_weights
    assert mixtral.moe.expert_intermediate_size == 32
    assert mixtral.moe.checkpoint_block == "block_sparse_moe"
    qwen3 = Qwen3MoeForCausalLM.parse_config(
        _qwen2_moe_config(num_experts=None, num_local_experts=8, norm_topk_prob=True)
    )
    assert qwen3.moe is not None and qwen3.moe.num_experts == 8 and qwen3.qk_norm
    assert qwen3.moe.norm_topk_prob and not qwen3.moe.float32_weights
    assert qwen3.moe.shared_expert_intermediate_size == 0


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (dict(num_experts_per_tok=9), "num_experts_per_tok=9 is larger than num_experts=8"),
        (dict(num_experts_per_tok=0), "num_experts_per_tok"),
        (dict(num_experts=None), "num_experts"),
        (dict(moe_intermediate_size=None), "moe_intermediate_size"),
        (dict(shared_expert_intermediate_size=None), "shared_expert_intermediate_size"),
        (dict(mlp_only_layers=[6]), "mlp_only_layers"),
        (dict(decoder_sparse_step=-1), "decoder_sparse_step"),
    ],
)
def test_bad_expert_fields_are_named(overrides, named):
    with pytest.raises(ValueError, match=named):
        Qwen2MoeForCausalLM.parse_config(_qwen2_moe_config(**overrides))


def test_mixtral_top_k_error_names_num_local_experts():
    cfg = _qwen2_moe_config(num_experts=None, num_local_experts=8, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="larger than num_local_experts=8"):
        MixtralForCausalLM.parse_config(cfg)


# ---- the C++ layer (runner/cpu/moe_kernel.py, csrc/moe.cpp) -------------------------------------


def _packed(arch: str, hf) -> SparseMoE:
    """Our layer in bf16 with its experts packed for the CPU kernels (as the engine loads it);
    skips where this CPU has no tiled linear kernel."""
    from infer.runner.cpu.fused_ops import cpu_ops
    from infer.runner.cpu.prepack import prepack_linears, tiled_linear_kernels

    if tiled_linear_kernels() is None:
        pytest.skip("the C++ expert layer needs the tiled linear kernels")
    ours = _ours(arch, hf).to(torch.bfloat16)
    prepack_linears(ours)
    assert ours.fused_kernel(cpu_ops()) is not None
    return ours


def _cpp_and_torch(ours: SparseMoE, x: torch.Tensor):
    """(the C++ layer's output, the torch code's, each one's rows per expert)."""
    with torch.inference_mode():
        before = ours.expert_rows.clone()
        got = ours(x)
        mid = ours.expert_rows.clone()
        want = ours.torch_forward(x)
        after = ours.expert_rows.clone()
    return got, want, mid - before, after - mid


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rows", [1, 3, 40])  # decode (experts side by side), prefill sizes
def test_cpp_layer_gives_the_torch_codes_experts_and_sums(arch, rows):
    """Same experts for every row, the same sums to bf16 rounding (the router's float32 sums
    and the softmax's exp are the kernel's own; everything after routing is the same kernels
    and the same rounding, so rows whose weights round alike are equal bit for bit)."""
    ours = _packed(arch, _hf_block(arch, num_experts=8, top_k=3, norm_topk_prob=True))
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got, want, cpp_rows, torch_rows = _cpp_and_torch(ours, x)
    assert torch.equal(cpp_rows, torch_rows) and cpp_rows.sum() == rows * 3
    assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()
    assert (got == want).all(-1).float().mean() >= 0.5


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_experts", [8, 128])  # torch.topk's selection and heap orders
def test_cpp_layer_breaks_ties_as_torch_topk(arch, num_experts):
    """Experts whose router rows are equal score equal logits: the C++ top-k keeps the ones
    torch.topk keeps (so transformers' choice), row by row."""
    hf = _hf_block(arch, num_experts=num_experts, top_k=2)
    with torch.no_grad():
        hf.gate.weight[1::2] = 0  # every odd expert scores 0
        hf.gate.weight[4] = hf.gate.weight[2]  # 2 and 4 tie
        hf.gate.weight[6] = hf.gate.weight[0] = 0
    ours = _packed(arch, hf)
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    x[:6] = 0  # every expert scores 0: a tie across all of them
    got, want, cpp_rows, torch_rows = _cpp_and_torch(ours, x)
    assert torch.equal(cpp_rows, torch_rows)
    for t in range(24):  # each row alone: its own experts, whatever the others chose
        g, w, cr, tr = _cpp_and_torch(ours, x[t : t + 1])
        assert torch.equal(cr, tr), t
        assert torch.equal(g, w), t
    assert torch.equal(got[:6], want[:6])


@pytest.mark.parametrize("arch", ARCHS)
def test_cpp_layer_one_expert_takes_every_row(arch):
    hf = _hf_block(arch, num_experts=8, top_k=1)
    with torch.no_grad():
        hf.gate.weight.zero_()
        hf.gate.weight[5, 0] = 50.0
    ours = _packed(arch, hf)
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    x[:, 0] = x[:, 0].abs() + 1
    got, want, cpp_rows, torch_rows = _cpp_and_torch(ours, x)
    assert cpp_rows.tolist() == torch_rows.tolist() == [0, 0, 0, 0, 0, 16, 0, 0]
    assert torch.equal(got, want)


def test_cpp_layer_top_k_equal_to_the_number_of_experts_and_empty_steps():
    for arch in ARCHS:
        ours = _packed(arch, _hf_block(arch, num_experts=4, top_k=4, norm_topk_prob=True))
        x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(5)).bfloat16()
        got, want, cpp_rows, _ = _cpp_and_torch(ours, x)
        assert cpp_rows.tolist() == [9, 9, 9, 9]
        assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()
        with torch.inference_mode():
            assert ours(x[:0]).shape == (0, HIDDEN)
