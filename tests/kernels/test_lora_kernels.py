"""kernels/lora.py: the segmented LoRA update (SGMV). The torch path against a per-row reference
built from PEFT-layout weights (delta W = scaling * B @ A per target), then the C++ kernel and
the Triton kernels (TRITON_INTERPRET=1 on the CPU, see conftest) against the torch path: mixed
slots with base-model rows (slot 0, rank 0, and slot -1), ranks below the maximum, fused
projections whose targets an adapter only partly has."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernels
from kernels.lora import LoRAWeights, batch_info, sgmv, sgmv_cpu, sgmv_torch

# (in_features, out sizes of the fused targets): o/down (one target), q/k/v, gate/up.
SHAPES = {"single": (40, [56]), "qkv": (64, [48, 16, 16]), "gate_up": (48, [40, 40])}
TOL = dict(atol=1e-4, rtol=1e-4)


def make_weights(
    in_f: int,
    outs: list[int],
    slots: int = 5,
    r_max: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[LoRAWeights, dict]:
    """Slots 1.. hold adapters of random ranks (some targets absent: rank 0), zero-padded; returns the
    weights and {(slot, target): (A [r, in], B [out, r], scaling)} in PEFT's layouts."""
    g = torch.Generator().manual_seed(seed)
    w = LoRAWeights.empty(slots, r_max, in_f, outs, dtype)
    offs = w.out_offsets.tolist()
    peft = {}
    for s in range(1, slots):
        for j, n in enumerate(outs):
            r = int(torch.randint(0, r_max + 1, (1,), generator=g)) if (s + j) % 4 else r_max
            if s == 2 and j == len(outs) - 1:
                r = 0  # an adapter without this target
            if r == 0:
                continue
            a = torch.randn(r, in_f, generator=g) / in_f**0.5
            b = torch.randn(n, r, generator=g)
            scaling = float(torch.rand(1, generator=g)) * 2 + 0.25
            w.lora_a[s, j * r_max : j * r_max + r] = a.to(dtype)
            w.lora_b[s, :r, offs[j] : offs[j + 1]] = b.T.to(dtype)
            w.ranks[s, j] = r
            w.scalings[s, j] = scaling
            peft[(s, j)] = (a, b, scaling)
    return w, peft


def per_row_reference(
    y: torch.Tensor, x: torch.Tensor, row_slots: list[int], outs: list[int], peft: dict
):
    y = y.clone().double()
    offs = [0]
    for n in outs:
        offs.append(offs[-1] + n)
    for i, s in enumerate(row_slots):
        for j in range(len(outs)):
            if (s, j) in peft:
                a, b, scaling = peft[(s, j)]
                delta = scaling * (b.double() @ a.double())  # what PEFT's merge adds to W [out, in]
                y[i, offs[j] : offs[j + 1]] += x[i].double() @ delta.T
    return y.float()


# Requests as (slot, rows): decode rows of several adapters, base rows (0 and -1), a long prefill
# segment (several row tiles of each kernel), neighbours of one slot (merged into one segment).
BATCH = [(1, 1), (0, 2), (3, 1), (-1, 1), (2, 19), (1, 3), (1, 1), (4, 5), (0, 1), (3, 2)]


def batch_inputs(in_f: int, n_out: int, seed: int = 1):
    slots = [s for s, _ in BATCH]
    rows = [n for _, n in BATCH]
    info = batch_info(slots, rows)
    row_slots = [s for s, n in BATCH for _ in range(n)]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(info.num_rows, in_f, generator=g)
    y = torch.randn(info.num_rows, n_out, generator=g)
    return info, row_slots, x, y


def test_batch_info_segments():
    info = batch_info([1, 1, 0, 2, 2, 2, -1], [3, 1, 2, 0, 4, 1, 1])
    assert info.seg_indptr_host == (0, 4, 6, 11, 12)
    assert info.weight_indices_host == (1, 0, 2, -1)
    assert info.max_seg_len == 5 and info.num_rows == 12
    assert info.seg_indptr.dtype == torch.int32 and info.seg_indptr.tolist() == list(
        info.seg_indptr_host
    )
    decode = batch_info([3, 1, 3])
    assert decode.seg_indptr_host == (0, 1, 2, 3) and decode.max_seg_len == 1
    assert batch_info([], []).num_segments == 0
    with pytest.raises(ValueError):
        batch_info([1, 2], [1])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_torch_path_matches_peft_delta_per_row(shape):
    in_f, outs = SHAPES[shape]
    w, peft = make_weights(in_f, outs)
    info, row_slots, x, y = batch_inputs(in_f, sum(outs))
    got = sgmv_torch(y.clone(), x, w, info)
    torch.testing.assert_close(got, per_row_reference(y, x, row_slots, outs, peft), **TOL)
    base = [i for i, s in enumerate(row_slots) if s <= 0]
    assert torch.equal(got[base], y[base])  # base-model rows are untouched


def test_zero_padding_past_rank_is_never_read():
    """Garbage past each rank changes nothing: kernels read only rank rows of A and B."""
    in_f, outs = SHAPES["qkv"]
    w, _ = make_weights(in_f, outs)
    info, _, x, y = batch_inputs(in_f, sum(outs))
    want = sgmv_torch(y.clone(), x, w, info)
    dirty = LoRAWeights(w.lora_a.clone(), w.lora_b.clone(), w.ranks, w.scalings, w.out_offsets)
    r_max = w.max_rank
    for s in range(w.lora_a.shape[0]):
        for j in range(w.num_targets):
            r = int(w.ranks[s, j])
            dirty.lora_a[s, j * r_max + r : (j + 1) * r_max] = float("nan")
    if cpu_kernels.load() is not None:
        torch.testing.assert_close(sgmv_cpu(y.clone(), x, dirty, info), want, **TOL)


needs_cpp = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="CPU kernels disabled or not buildable here"
)


@needs_cpp
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cpp_matches_torch(shape):
    in_f, outs = SHAPES[shape]
    w, _ = make_weights(in_f, outs, seed=2)
    info, _, x, y = batch_inputs(in_f, sum(outs), seed=3)
    torch.testing.assert_close(
        sgmv_cpu(y.clone(), x, w, info), sgmv_torch(y.clone(), x, w, info), **TOL
    )
    torch.testing.assert_close(
        sgmv(y.clone(), x, w, info), sgmv_torch(y.clone(), x, w, info), **TOL
    )


@needs_cpp
def test_cpp_odd_sizes_strided_rows_and_bfloat16():
    """K and N not multiples of the vector width, x a column slice of a wider tensor, rank 1 and
    the full rank; bfloat16 rounds y once, as the torch path does."""
    w, _ = make_weights(37, [13, 7, 7], slots=4, r_max=5, seed=4)
    info = batch_info([1, 2, 3, 0], [2, 17, 1, 3])
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(info.num_rows, 50, generator=g)
    x = wide[:, 3:40]
    y = torch.randn(info.num_rows, 27, generator=g)
    torch.testing.assert_close(
        sgmv_cpu(y.clone(), x, w, info), sgmv_torch(y.clone(), x, w, info), **TOL
    )
    bf = torch.bfloat16
    wb = LoRAWeights(w.lora_a.to(bf), w.lora_b.to(bf), w.ranks, w.scalings, w.out_offsets)
    got = sgmv_cpu(y.to(bf), x.to(bf), wb, info)
    want = sgmv_torch(y.to(bf), x.to(bf), wb, info)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=1e-2)


@needs_cpp
def test_cpp_rejects_bad_inputs():
    w, _ = make_weights(40, [56])
    info = batch_info([1], [2])
    with pytest.raises(RuntimeError, match="slot"):
        sgmv_cpu(torch.zeros(2, 56), torch.zeros(2, 40), w, batch_info([9], [2]))
    with pytest.raises(ValueError):
        sgmv_cpu(torch.zeros(2, 55), torch.zeros(2, 40), w, info)


def test_triton_matches_torch():
    pytest.importorskip("triton")
    from kernels.triton_lora import SgmvConfig, triton_sgmv

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for shape, cfg in (
        ("qkv", None),
        ("gate_up", SgmvConfig(16, 16, 16)),
        ("single", SgmvConfig(32, 64, 64)),
    ):
        in_f, outs = SHAPES[shape]
        w, _ = make_weights(in_f, outs, seed=6)
        info, _, x, y = batch_inputs(in_f, sum(outs), seed=7)
        want = sgmv_torch(y.clone(), x, w, info)
        wd = LoRAWeights(*(t.to(dev) for t in w))
        infod = info._replace(
            seg_indptr=info.seg_indptr.to(dev), weight_indices=info.weight_indices.to(dev)
        )
        got = triton_sgmv(y.clone().to(dev), x.to(dev), wd, infod, cfg)
        torch.testing.assert_close(got.cpu(), want, **TOL, msg=shape)
