"""4-bit weights: the quantizer's bounds, the packed layout, and the kernels (bf16 activations on
AVX-512 BF16 and, on any x86 CPU with AVX2, the AVX2 one; int8 activations on VNNI) against a
float64 / exact integer reference over shapes, groups, zero and extreme groups; batch and thread
invariance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer.model.quantized_checkpoint import KQuantScales, Q6KScales
from infer.runner.cpu.kernels import INT4_AVX2
from infer.runner.int4 import (
    Int4Linear,
    dequantize_int4,
    dequantize_kquant,
    dequantize_q6k,
    int4_kernel_available,
    pack_int4,
    pack_kquant,
    pack_q6k,
    quantize_int4,
    unpack_int4,
    unpack_kquant,
    unpack_q6k,
    w4a8_kernel_reference,
)

needs_kernel = pytest.mark.skipif(
    not int4_kernel_available(torch.device("cpu")), reason="needs AVX-512 BF16 or AVX2, and a g++"
)
needs_w4a8 = pytest.mark.skipif(
    not int4_kernel_available(torch.device("cpu"), int8_activations=True),
    reason="needs AVX-512 VNNI and a g++",
)


def _bf16_reference(x, q, scales, zeros):
    """The int4 kernel's product in float64: x as it is times the dequantized weight."""
    return x.double() @ dequantize_int4(q, scales, zeros, torch.float64).t()


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 64, -1])
def test_quantize_int4_error_is_at_most_half_a_step(group, symmetric):
    torch.manual_seed(0)
    w = torch.randn(48, 128) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different size
    w[3, :32] = 0.0  # an all-zero group
    w[5, 40] = 300.0  # an extreme one
    q, scales, zeros = quantize_int4(w, group, symmetric)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scales.dtype == torch.float16 and zeros.dtype == torch.uint8
    got = dequantize_int4(q, scales, zeros, torch.float32)
    g = 128 if group == -1 else group
    step = scales.float().repeat_interleave(g, dim=1)
    assert torch.all((got - w).abs() <= step * 0.5 + 1e-6 * w.abs())
    assert torch.all(got[3, :32] == 0)  # zero stays exactly zero (it is in every range)


def test_quantize_int4_refuses_groups_that_do_not_divide():
    with pytest.raises(ValueError, match="96 inputs do not split into groups of 64"):
        quantize_int4(torch.randn(16, 96), 64)


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("n", [32, 17])
def test_packed_layout_round_trips_to_the_quantized_weight(n, int8_activations):
    """The kernel's packing (and the plain packing of the dequantizing path) give back exactly
    ``scale * (q - zero)``, for an output count the kernel has to pad."""
    torch.manual_seed(1)
    q = torch.randint(0, 16, (n, 64), dtype=torch.uint8)
    scales = torch.rand(n, 2).to(torch.float16)
    zeros = torch.randint(0, 17, (n, 2), dtype=torch.uint8)  # GPTQ's zeros reach 16
    want = dequantize_int4(q, scales, zeros, torch.float32)
    for dtype in (torch.float32, torch.bfloat16):  # the dequantizing path, the kernel's
        layer = Int4Linear(q, scales, zeros, None, dtype, int8_activations=int8_activations)
        assert torch.equal(layer.dequantized_weight(), want.to(dtype))
    if layer.mode == "kernel":
        assert layer.packed.shape == ((n + 15) // 16, 8, 64)
        assert layer.weight_bytes == layer.packed.numel() + 3 * layer.scales.numel()


def test_5bit_weights_pack_as_nibbles_and_a_bit_plane():
    """GGUF's Q5 values (0..31): the w4a8 layout's nibbles plus a 16-byte plane of their fifth
    bits, each at its byte's place; they come back exactly."""
    bits = 5
    torch.manual_seed(bits)
    n, k = 32, 64
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
    scales = torch.rand(n, 4).to(torch.float16)
    zeros = torch.full((n, 4), 1 << (bits - 1), dtype=torch.uint8)
    packed, _, _ = pack_int4(q, scales, zeros, int8_activations=True, bits=bits)
    assert packed.shape == (2, 8, 64 + 16 * (bits - 4))
    assert torch.equal(unpack_int4(packed, int8_activations=True), q)
    # output 1, input 8 * 3 + 4 + 2 (octet 3, high nibble, j = 2): byte p = 4 * 1 + 2 = 6 of
    # the second mask of each plane
    q2 = torch.zeros_like(q)
    q2[1, 30] = (1 << bits) - 1
    packed, _, _ = pack_int4(q2, scales, zeros, int8_activations=True, bits=bits)
    assert packed[0, 3, 6].item() == 0xF0 and packed[0, 3, :64].count_nonzero().item() == 1
    assert packed[0, 3, 64:].tolist() == [0] * 8 + [1 << 6] + [0] * 7
    want = dequantize_int4(q, scales, zeros, torch.float32)
    for dtype in (torch.float32, torch.bfloat16):  # the dequantizing path, the kernel's
        layer = Int4Linear(q, scales, zeros, None, dtype, int8_activations=True, bits=bits)
        assert torch.equal(layer.dequantized_weight(), want.to(dtype))
    with pytest.raises(ValueError, match="w4a8 kernel only"):
        pack_int4(q, scales, zeros, int8_activations=False, bits=bits)
    with pytest.raises(ValueError, match="7-bit weights"):
        pack_int4(q, scales, zeros, int8_activations=True, bits=7)


SHAPES = [  # (rows, in, out, group)
    (1, 256, 32, 32),
    (3, 512, 48, 64),
    (8, 128, 16, 128),
    (9, 256, 64, 256),  # one group per row
    (17, 64, 80, 32),
    (40, 96, 16, 32),
    (13, 256, 32, 128),  # the AVX2 kernel's rows in sixes (groups of up to 128), a lone row
    (26, 512, 32, 256),  # larger groups: in fours, a pair
]


def _kernel_f32(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """The kernel's float32 sums (before the bf16 rounding a bf16 model's layer applies)."""
    assert layer.mode == "kernel"
    y = layer._kernels.int4_linear(
        x.bfloat16().contiguous(), layer.packed, layer.scales, layer.zeros, None,
        layer.out_features + layer.padded, layer.group_size, layer.kernel_flags, torch.float32,
    )  # fmt: skip
    return y[:, : layer.out_features].double()


def _random_layer(m, k, n, group):
    torch.manual_seed(m * 1000 + k)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = (torch.rand(n, k // group) * 0.1).to(torch.float16)
    zeros = torch.randint(0, 17, (n, k // group), dtype=torch.uint8)
    scales[0, 0] = 0  # a group that contributes nothing
    x = (torch.randn(m, k) * 3).bfloat16()
    x[0, :group] = 0  # an all-zero activation group
    if m > 2:
        x[2, 5] = 1e4  # an extreme activation (in w4a8, its group's other values round to 0)
    return x, q, scales, zeros


KERNELS = [
    pytest.param(False, False, marks=needs_kernel),
    pytest.param(False, True, marks=needs_kernel),
    pytest.param(True, False, marks=needs_w4a8),
]
KERNEL_IDS = ["int4", "int4-avx2", "w4a8"]


def _on_avx2(layer: Int4Linear, avx2: bool) -> Int4Linear:
    """The layer through the AVX2 kernel (``avx2``) or the CPU's own (AVX-512 BF16 where it has
    it): the AVX2 one is checked on every x86 CPU, not only where it is the one that runs."""
    if avx2:
        layer.kernel_flags |= INT4_AVX2
    return layer


@needs_kernel
@pytest.mark.parametrize("avx2", [False, True], ids=["native", "avx2"])
@pytest.mark.parametrize("m,k,n,group", SHAPES)
def test_int4_kernel_matches_the_dequantized_product(m, k, n, group, avx2):
    x, q, scales, zeros = _random_layer(m, k, n, group)
    layer = _on_avx2(Int4Linear(q, scales, zeros, None, torch.bfloat16), avx2)
    want = _bf16_reference(x, q, scales, zeros)
    got = _kernel_f32(layer, x)
    # float32 sums that carry 128 + q for each weight (the kernel's doc): ~1e-6 of the row
    tol = 1e-5 * (x.double().abs() @ torch.full((k, n), 128.0 * 0.1, dtype=torch.float64))
    assert torch.all((got - want).abs() <= tol + 1e-6)
    # bf16 model: the same sums, rounded once
    got16 = _on_avx2(Int4Linear(q, scales, zeros, None, torch.bfloat16), avx2)(x)
    assert torch.all((got16.double() - want).abs() <= tol + want.abs() / 128)


@needs_kernel
@pytest.mark.parametrize("avx2", [False, True], ids=["native", "avx2"])
@pytest.mark.parametrize("m,k,n,group", SHAPES)
def test_int4_kernel_takes_float16_zeros(m, k, n, group, avx2):
    """GGUF's Q4_1 / Q4_K groups: a zero that is a ratio, held as float16 (negative and past 15
    too), read by the same kernels (the w4a8 kernel takes the zero's product in float32)."""
    x, q, scales, _ = _random_layer(m, k, n, group)
    torch.manual_seed(n)
    zeros = (torch.rand(n, k // group) * 40 - 8).to(torch.float16)
    layer = _on_avx2(Int4Linear(q, scales, zeros, None, torch.bfloat16), avx2)
    assert layer.mode == "kernel" and layer.zeros.dtype == torch.float16
    want = _bf16_reference(x, q, scales, zeros)
    got = _kernel_f32(layer, x)
    tol = 1e-5 * (x.double().abs() @ torch.full((k, n), 160.0 * 0.1, dtype=torch.float64))
    assert torch.all((got - want).abs() <= tol + 1e-6)
    if not int4_kernel_available(torch.device("cpu"), int8_activations=True):
        return
    w4a8 = Int4Linear(q, scales, zeros, None, torch.bfloat16, int8_activations=True)
    assert w4a8.mode == "kernel" and w4a8.zeros.dtype == torch.float16
    want = w4a8_kernel_reference(x, q, scales, zeros)
    got = _kernel_f32(w4a8, x)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item() + 1e-6


@needs_w4a8
@pytest.mark.parametrize("m,k,n,group", SHAPES)
def test_w4a8_kernel_matches_the_integer_reference(m, k, n, group):
    x, q, scales, zeros = _random_layer(m, k, n, group)
    layer = Int4Linear(q, scales, zeros, None, torch.bfloat16, int8_activations=True)
    want = w4a8_kernel_reference(x, q, scales, zeros)
    got = _kernel_f32(layer, x)
    tol = 1e-5 * want.abs().max().item() + 1e-6
    assert (got - want).abs().max().item() <= tol
    got16 = Int4Linear(q, scales, zeros, None, torch.bfloat16, int8_activations=True)(x)
    torch.testing.assert_close(got16.float(), want.float().bfloat16().float(), atol=tol, rtol=8e-3)


@needs_w4a8
@pytest.mark.parametrize("group", [16, 32, 128])
@pytest.mark.parametrize("half_zeros", [False, True])
def test_w4a8_kernel_takes_5bit_weights(group, half_zeros):
    """The bit plane puts each value's fifth bit back: the kernel's sums are the integer
    reference's, for every row count a pass takes (1, 8, 9, 17 rows) and a padded output."""
    bits = 5
    for m, n in ((1, 48), (8, 16), (9, 40), (17, 32)):
        torch.manual_seed(m * 7 + bits)
        k = 128
        q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
        scales = ((torch.rand(n, k // group) - 0.3) * 0.1).to(torch.float16)  # some negative
        zeros = torch.full((n, k // group), 1 << (bits - 1), dtype=torch.uint8)
        if half_zeros:
            zeros = (torch.rand(n, k // group) * 80 - 8).to(torch.float16)
        x = (torch.randn(m, k) * 3).bfloat16()
        layer = Int4Linear(q, scales, zeros, None, torch.bfloat16, int8_activations=True,
                           bits=bits)  # fmt: skip
        assert layer.mode == "kernel"
        want = w4a8_kernel_reference(x, q, scales, zeros)
        got = _kernel_f32(layer, x)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item() + 1e-6


def _random_kquant(n: int, k: int, seed: int) -> KQuantScales:
    g = torch.Generator().manual_seed(seed)
    sc = torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=g)
    m = torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 256, generator=g) * 0.01).to(torch.float16)
    dmin = (torch.rand(n, k // 256, generator=g) * 0.01).to(torch.float16)
    return KQuantScales(sc, m, d, dmin)


def test_kquant_records_round_trip():
    """GGUF's K-quant scales packed as the kernel's 320-byte records (sc, m per group; d, dmin
    per super-block, each 16 outputs wide) come back exactly."""
    kq = _random_kquant(32, 512, seed=1)
    records = pack_kquant(kq)
    assert records.shape == (2, 2, 320)
    # output 17 (block 1, c 1), group 9 (super-block 1, j 1): sc at byte 16 j + c
    assert records[1, 1, 16 * 1 + 1].item() == kq.sc[17, 9].item()
    back = unpack_kquant(records)
    for field in ("sc", "m", "d", "dmin"):
        assert torch.equal(getattr(back, field), getattr(kq, field))


@needs_w4a8
@pytest.mark.parametrize("bits", [4, 5])
def test_w4a8_kernel_reads_kquant_records(bits):
    """Q4_K / Q5_K layers held with the file's own scales (4.625 / 5.625 bits a weight): the
    kernel's sums are the reference's ``d sc dot - dmin m xsum``, its weight the file's
    ``d sc q - dmin m``; padded outputs and every pass size; bf16 activations (no K-quant
    kernel) take the float16 scales and zeros."""
    for m_rows, n in ((1, 48), (9, 40), (17, 32)):
        k = 512
        torch.manual_seed(m_rows + bits)
        q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
        kq = _random_kquant(n, k, seed=m_rows)
        want_w = dequantize_kquant(q, kq, torch.float32)
        scale = kq.d.float().repeat_interleave(8, dim=1) * kq.sc.float()
        offset = kq.dmin.float().repeat_interleave(8, dim=1) * kq.m.float()
        scales16 = scale.clamp(min=2**-14).to(torch.float16)
        zeros16 = (offset / scales16.float()).to(torch.float16)
        x = (torch.randn(m_rows, k) * 3).bfloat16()
        layer = Int4Linear(q, scales16, zeros16, None, torch.bfloat16, int8_activations=True,
                           bits=bits, kquant=kq)  # fmt: skip
        assert layer.mode == "kernel" and layer.kquant
        assert layer.weight_bytes == (n + layer.padded) * k * (bits * 8 + 5) // 64
        assert torch.equal(layer.dequantized_weight(), want_w.bfloat16())
        want = w4a8_kernel_reference(x, q, scales16, zeros16, kq)
        got = _kernel_f32(layer, x)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item() + 1e-6
    if bits == 4 and int4_kernel_available(torch.device("cpu")):
        plain = Int4Linear(q, scales16, zeros16, None, torch.bfloat16, kquant=kq)
        assert plain.mode == "kernel" and not plain.kquant and plain.zeros.dtype == torch.float16


def _random_q6k(n: int, k: int, seed: int) -> tuple[torch.Tensor, Q6KScales]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=g)
    sc = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=g)
    d = (torch.rand(n, k // 256, generator=g) * 0.001).to(torch.float16)
    return q, Q6KScales(sc, d)


def test_q6k_values_and_records_round_trip():
    """6-bit values pack as the nibbles plus two bit planes and come back; Q6_K's scales
    packed as the kernel's 288-byte records (an int8 sc per 16 inputs, a float16 d per 256,
    each 16 outputs wide) come back exactly."""
    q, scales = _random_q6k(32, 512, seed=4)
    packed, _, _ = pack_int4(q, torch.zeros(32, 16, dtype=torch.float16),
                             torch.zeros(32, 16, dtype=torch.uint8), True, bits=6)  # fmt: skip
    assert packed.shape == (2, 64, 96)  # 64 nibble bytes + 2 x 16 plane bytes per 8 inputs
    assert torch.equal(unpack_int4(packed, int8_activations=True), q)
    records = pack_q6k(scales)
    assert records.shape == (2, 2, 288)
    # output 17 (block 1, c 1), sub-group 21 (super-block 1, s 5): sc at byte 16 s + c
    assert records[1, 1, 16 * 5 + 1].view(torch.int8).item() == scales.sc[17, 21].item()
    back = unpack_q6k(records)
    assert torch.equal(back.sc, scales.sc) and torch.equal(back.d, scales.d)
    with pytest.raises(ValueError, match="6-bit weights"):
        pack_int4(q, torch.zeros(32, 16, dtype=torch.float16),
                  torch.zeros(32, 16, dtype=torch.uint8), False, bits=6)  # fmt: skip


@needs_w4a8
@pytest.mark.parametrize("group", [32, 256])
def test_w4a8_kernel_reads_q6k(group):
    """Q6_K layers held as the file stores them (6.5625 bits a weight): the kernel's sums are
    the reference's (each 16 inputs' integer product with q - 32 times its int8 sc, d and the
    activations' scale per group), for every pass size and a padded output; the weight is the
    file's ``d sc (q - 32)``. Without int8 activations the float16 ``d sc`` and zeros 32 serve,
    dequantized."""
    for m_rows, n in ((1, 48), (8, 16), (9, 40), (17, 32)):
        k = 512
        q, scales = _random_q6k(n, k, seed=m_rows)
        scales16 = (scales.d.float().repeat_interleave(16, dim=1) * scales.sc.float()).half()
        zeros = torch.full(scales16.shape, 32, dtype=torch.uint8)
        x = (torch.randn(m_rows, k) * 3).bfloat16()
        x[0, :256] *= 50  # (one super-block's activations far larger: their own scale)
        layer = Int4Linear(q, scales16, zeros, None, torch.bfloat16, int8_activations=True,
                           bits=6, kquant=scales)  # fmt: skip
        assert layer.mode == "kernel" and layer.q6k and not layer.kquant
        assert layer.weight_bytes == (n + layer.padded) * k * 105 // 128  # 6.5625 bits
        assert torch.equal(layer.dequantized_weight(),
                           dequantize_q6k(q, scales, torch.float32).bfloat16())  # fmt: skip
        layer.group_size = group
        want = w4a8_kernel_reference(x, q, scales16, zeros, scales, group=group)
        got = _kernel_f32(layer, x)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item() + 1e-6
    plain = Int4Linear(q, scales16, zeros, None, torch.bfloat16, bits=6, kquant=scales)
    assert plain.mode == "dequant"
    want = F.linear(x.float(), dequantize_q6k(q, scales, torch.float32))
    got = plain(x).float()
    assert (got - want).abs().max() <= 0.01 * want.abs().max()


@pytest.mark.parametrize("int8_activations,avx2", KERNELS, ids=KERNEL_IDS)
def test_kernels_are_close_to_the_float_product_and_add_bias(int8_activations, avx2):
    torch.manual_seed(2)
    w, b = torch.randn(40, 256), torch.randn(40)
    x = torch.randn(5, 256).bfloat16()
    layer = Int4Linear.from_weight(w.bfloat16(), b.bfloat16(), int8_activations=int8_activations)
    _on_avx2(layer, avx2)
    want = F.linear(x.float(), layer.dequantized_weight().float(), b.bfloat16().float())
    got = layer(x).float()
    assert got.shape == (5, 40)
    # bf16 output rounding; int8 activations per group of 32: ~0.5% of a row's scale
    assert (got - want).abs().max() <= (0.02 if int8_activations else 0.008) * want.abs().max()


@pytest.mark.parametrize("int8_activations,avx2", KERNELS, ids=KERNEL_IDS)
def test_a_rows_result_depends_on_nothing_but_the_row(int8_activations, avx2):
    """The same token gives the same bits alone, in any batch (any pass of rows: the AVX2
    kernel's fours, pairs and lone row) and with any thread count."""
    torch.manual_seed(3)
    layer = Int4Linear.from_weight(torch.randn(96, 512).bfloat16(), None,
                                   int8_activations=int8_activations)  # fmt: skip
    _on_avx2(layer, avx2)
    x = torch.randn(23, 512).bfloat16()  # 5 fours, a pair, a lone row
    batched = layer(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single_thread = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, single_thread)
    for i in range(23):
        assert torch.equal(layer(x[i : i + 1])[0], batched[i]), i
    for m in (2, 3, 6):
        assert torch.equal(layer(x[1 : 1 + m]), batched[1 : 1 + m]), m


@pytest.mark.parametrize("rows", [3, 7])
@pytest.mark.parametrize("int8_activations,avx2", KERNELS, ids=KERNEL_IDS)
def test_a_non_finite_row_stays_in_its_row(int8_activations, avx2, rows):
    layer = Int4Linear.from_weight(torch.randn(16, 64).bfloat16(), None,
                                   int8_activations=int8_activations)  # fmt: skip
    _on_avx2(layer, avx2)
    x = torch.randn(rows, 64).bfloat16()
    x[1, 3] = float("inf")
    y = layer(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, *range(2, rows)]]).all()


def test_act_order_permutation_gathers_inputs_into_group_order():
    """GPTQ's act-order: the layer holds its weight in group order and gathers x the same way,
    so the product is the original one."""
    torch.manual_seed(4)
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    scales = (torch.rand(32, 2) * 0.1).to(torch.float16)
    zeros = torch.full((32, 2), 8, dtype=torch.uint8)
    perm = torch.randperm(64)
    plain = Int4Linear(q, scales, zeros, None, torch.float32)
    w_grouped = plain.dequantized_weight()
    w_original = torch.empty_like(w_grouped)
    w_original[:, perm] = w_grouped  # input perm[i] of the checkpoint is column i in group order
    permuted = Int4Linear(q, scales, zeros, None, torch.float32, perm=perm)
    x = torch.randn(4, 64)
    want = F.linear(x, w_original)
    assert (permuted(x) - want).abs().max() <= 0.02 * want.abs().max()
