"""Delta encoding of weight versions and LoRA merging (weightsync/delta.py): bit-exact in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.weightsync.delta import (
    AdapterShapeError,
    Delta,
    DeltaError,
    adapter_name,
    adapter_target,
    apply_delta,
    apply_delta_,
    bits_view,
    choose_encoding,
    compute_delta,
    encoded_nbytes,
    from_peft_name,
    is_adapter_name,
    lora_scale,
    merge_adapters,
    merge_lora,
    pack_bits,
    pair_adapters,
    peft_adapter_config,
    to_peft_name,
    unpack_bits,
)

DTYPES = [torch.bfloat16, torch.float32]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits_view(a), bits_view(b))


def perturbed(prev: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """``prev`` with about ``fraction`` of its elements replaced by other values."""
    g = torch.Generator().manual_seed(seed)
    new = prev.clone()
    flat = new.view(-1)
    pick = torch.rand(flat.numel(), generator=g) < fraction
    flat[pick] = torch.randn(int(pick.sum()), generator=g).to(prev.dtype)
    return new


# ------------------------------------------------------------------------------------------ delta
@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 37), min_size=1, max_size=3),
    fraction=st.sampled_from([0.0, 0.001, 0.02, 0.1, 0.3, 0.6, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_delta_rebuilds_the_new_tensor_bit_for_bit(dtype, shape, fraction, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    prev = torch.randn(*shape, generator=g).to(dtype)
    new = perturbed(prev, fraction, seed + 1)
    d = compute_delta(prev, new)
    assert same_bits(apply_delta(prev, d), new)
    # the chosen encoding is never larger than a dense push, and is the smallest one
    assert d.nbytes <= d.dense_nbytes
    changed = int((bits_view(prev) != bits_view(new)).sum())
    sizes = encoded_nbytes(prev.numel(), changed, prev.element_size())
    assert d.nbytes == min(sizes.values())
    # every encoding, forced, rebuilds the same bits
    for enc in ("sparse", "mask", "dense"):
        assert same_bits(apply_delta(prev, compute_delta(prev, new, allowed=[enc])), new)


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_sees_bits_not_values(dtype) -> None:
    """-0.0 vs 0.0 and NaN payloads are changes a value comparison would miss or invent."""
    prev = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=dtype)
    new = torch.tensor([-0.0, 1.0, float("nan"), 3.0], dtype=dtype)
    d = compute_delta(prev, new, allowed=["sparse"])
    assert d.indices.tolist() == [0, 3]  # the NaN kept its bits; the zero changed sign
    out = apply_delta(prev, d)
    assert same_bits(out, new)
    assert torch.signbit(out[0])


def test_unchanged_tensor_costs_nothing_and_full_change_is_dense() -> None:
    prev = torch.randn(1000).to(torch.bfloat16)
    d = compute_delta(prev, prev.clone())
    assert d.encoding == "sparse" and d.nbytes == 0 and d.changed == 0
    assert same_bits(apply_delta(prev, d), prev)
    d = compute_delta(prev, prev + 1)
    assert d.encoding == "dense" and d.nbytes == d.dense_nbytes


def test_encoding_choice_follows_bytes() -> None:
    n = 1 << 20
    # bf16: sparse 6 bytes per change, mask n/8 + 2 per change, dense 2n
    assert choose_encoding(n, n // 100, 2) == "sparse"  # 1%: 0.06 MB vs 0.15 MB
    assert choose_encoding(n, n // 10, 2) == "mask"  # 10%: 0.63 vs 0.34
    assert choose_encoding(n, n - 1, 2) == "dense"
    assert choose_encoding(n, n // 10, 2, allowed=["sparse", "dense"]) == "sparse"  # 0.63 < 2
    assert choose_encoding(n, n // 2, 2, allowed=["sparse", "dense"]) == "dense"  # 3 bytes/elt > 2
    # a tie goes to dense
    sizes = encoded_nbytes(8, 2, 4)
    assert sizes["sparse"] == 16 and choose_encoding(8, 4, 2, allowed=["sparse", "dense"]) == "dense"
    with pytest.raises(ValueError):
        choose_encoding(n, 1, 2, allowed=[])


@settings(max_examples=40, deadline=None)
@given(bits=st.lists(st.booleans(), min_size=0, max_size=70))
def test_pack_bits_round_trips(bits) -> None:
    mask = torch.tensor(bits, dtype=torch.bool)
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == (len(bits) + 7) // 8
    assert unpack_bits(packed, len(bits)).tolist() == bits


def test_pack_bits_layout_is_little_endian() -> None:
    mask = torch.zeros(16, dtype=torch.bool)
    mask[0] = mask[9] = True
    assert pack_bits(mask).tolist() == [1, 2]


def test_apply_in_place_writes_the_previous_tensor() -> None:
    prev = torch.randn(4, 8)
    new = perturbed(prev, 0.2, 3)
    target = prev.clone()
    out = apply_delta_(target, compute_delta(prev, new))
    assert out is target and same_bits(target, new)


def test_mismatched_deltas_are_refused() -> None:
    a = torch.zeros(4, 4, dtype=torch.bfloat16)
    with pytest.raises(DeltaError):
        compute_delta(a, torch.zeros(4, 4))  # dtype differs
    with pytest.raises(DeltaError):
        compute_delta(a, torch.zeros(16, dtype=torch.bfloat16))  # shape differs
    d = compute_delta(a, a + 1)
    with pytest.raises(DeltaError):
        apply_delta(torch.zeros(4, 4), d)
    with pytest.raises(DeltaError):
        apply_delta_(torch.zeros(4, 8, dtype=torch.bfloat16)[:, :4], d)  # not contiguous
    bad = Delta(
        "sparse",
        (4, 4),
        torch.bfloat16,
        torch.ones(1, dtype=torch.bfloat16),
        indices=torch.tensor([16], dtype=torch.int32),
    )
    with pytest.raises(DeltaError, match="out of range"):
        apply_delta(a, bad)
    bad = Delta(
        "mask",
        (4, 4),
        torch.bfloat16,
        torch.ones(3, dtype=torch.bfloat16),
        mask=pack_bits(torch.ones(16, dtype=torch.bool)),
    )
    with pytest.raises(DeltaError, match="marks 16"):
        apply_delta(a, bad)


# ------------------------------------------------------------------------------------------ LoRA
def test_adapter_names_map_to_peft_and_back() -> None:
    module = "model.layers.3.self_attn.q_proj"
    a, b = adapter_name(module, "A"), adapter_name(module, "B")
    assert (a, b) == (f"{module}.lora_A.weight", f"{module}.lora_B.weight")
    assert is_adapter_name(a) and is_adapter_name(b) and not is_adapter_name(f"{module}.weight")
    assert adapter_target(a) == (f"{module}.weight", "A")
    assert adapter_target(b) == (f"{module}.weight", "B")
    assert to_peft_name(a) == f"base_model.model.{module}.lora_A.weight"
    assert from_peft_name(to_peft_name(b)) == b
    assert from_peft_name(f"base_model.model.{module}.lora_B.default.weight") == b
    with pytest.raises(ValueError):
        adapter_target(f"{module}.weight")
    with pytest.raises(ValueError):
        from_peft_name(a)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_is_exact_on_representable_values(dtype) -> None:
    """Small integers and a power-of-two scale: W + s B A has one exact answer, and merge gives it."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-8, 8, (6, 5), generator=g).to(dtype)
    a = torch.randint(-3, 4, (2, 5), generator=g).to(dtype)
    b = torch.randint(-3, 4, (6, 2), generator=g).to(dtype)
    scale = lora_scale(alpha=4, rank=2)  # 2.0
    expected = (w.double() + scale * (b.double() @ a.double())).to(dtype)
    out = merge_lora(w, a, b, scale)
    assert out.dtype == dtype and same_bits(out, expected)
    assert same_bits(w, torch.randint(-8, 8, (6, 5), generator=torch.Generator().manual_seed(0)).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_is_deterministic_and_matches_the_lora_forward(dtype) -> None:
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 48, generator=g) * 0.02).to(dtype)
    a = torch.randn(8, 48, generator=g) * 0.01
    b = torch.randn(64, 8, generator=g) * 0.01
    scale = lora_scale(16, 8)
    first, second = merge_lora(w, a, b, scale), merge_lora(w.clone(), a.clone(), b.clone(), scale)
    assert same_bits(first, second)
    x = torch.randn(3, 48, generator=g)
    lora_out = x @ w.float().T + scale * (x @ a.T) @ b.T
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(x @ first.float().T, lora_out, atol=tol, rtol=tol)


def test_merge_adapters_merges_each_pair_and_guards_shapes() -> None:
    base = {"m.q.weight": torch.randn(6, 4), "m.v.weight": torch.randn(5, 4), "m.o.weight": torch.randn(4, 4)}
    adapters = {
        "m.q.lora_A.weight": torch.randn(2, 4),
        "m.q.lora_B.weight": torch.randn(6, 2),
        "m.v.lora_A.weight": torch.randn(2, 4),
        "m.v.lora_B.weight": torch.randn(5, 2),
    }
    merged = merge_adapters(base, adapters, 0.5)
    assert sorted(merged) == ["m.q.weight", "m.v.weight"]
    for name in merged:
        a, b = pair_adapters(adapters)[name]
        assert same_bits(merged[name], merge_lora(base[name], a, b, 0.5))
    wrong = dict(adapters, **{"m.v.lora_B.weight": torch.randn(6, 2)})
    with pytest.raises(AdapterShapeError, match="m.v.weight"):
        merge_adapters(base, wrong, 0.5)
    with pytest.raises(AdapterShapeError, match="does not have"):
        merge_adapters(
            base, {"m.k.lora_A.weight": torch.randn(2, 4), "m.k.lora_B.weight": torch.randn(4, 2)}, 1
        )
    with pytest.raises(AdapterShapeError, match="B tensor missing"):
        pair_adapters({"m.q.lora_A.weight": torch.randn(2, 4)})
    with pytest.raises(ValueError):
        lora_scale(16, 0)


def test_peft_adapter_config_fields() -> None:
    cfg = peft_adapter_config(16, 32.0, ["v_proj", "q_proj", "q_proj"], 0.05, "/models/x")
    assert cfg["r"] == 16 and cfg["lora_alpha"] == 32.0 and cfg["target_modules"] == ["q_proj", "v_proj"]
    assert cfg["peft_type"] == "LORA" and cfg["base_model_name_or_path"] == "/models/x"


# ------------------------------------------------------------------------------------------ measurement
def test_changed_fraction_measurement_grows_with_the_learning_rate(tiny_model_path) -> None:
    from slipstream.system.bench_send_less import measure_changed_fraction

    small = measure_changed_fraction(str(tiny_model_path), 1e-6, 2, batch=2, seq_len=16)
    large = measure_changed_fraction(str(tiny_model_path), 1e-2, 2, batch=2, seq_len=16)
    assert small["exact"] and large["exact"] and len(small["steps"]) == 2
    assert 0.0 <= small["changed_fraction"] < large["changed_fraction"] <= 1.0
    assert large["changed_fraction"] > 0.5  # 1e-2 moves almost every bf16 value of a random init
    for res in (small, large):
        for row in res["steps"]:
            assert 0 <= row["delta_bytes"] <= row["dense_bytes"]
    assert small["bytes_ratio"] < large["bytes_ratio"]


def test_adapter_shapes_and_the_smollm2_adapter_share() -> None:
    from slipstream.system.bench_send_less import lora_bytes_ratio
    from slipstream.system.bench_transport import SMOLLM2_135M, model_shapes
    from slipstream.weightsync.delta import adapter_shapes

    base = [("m.layers.0.q_proj.weight", (8, 6)), ("m.layers.0.q_proj.bias", (8,)), ("m.norm.weight", (6,))]
    assert adapter_shapes(base, 2, ["q_proj", "norm"]) == [
        ("m.layers.0.q_proj.lora_A.weight", (2, 6)),
        ("m.layers.0.q_proj.lora_B.weight", (8, 2)),
    ]
    shapes = model_shapes(SMOLLM2_135M)
    assert sum(1 for _ in adapter_shapes(shapes, 16, ["q_proj", "down_proj"])) == 2 * 2 * 30
    assert lora_bytes_ratio(shapes, 16) == pytest.approx(4_884_480 / 134_515_008)
