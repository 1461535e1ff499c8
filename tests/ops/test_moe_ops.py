"""Tests of ``ckvp::moe_experts`` (ckvp_compile/ops/moe.py) and its references (kernels/moe_reference.py).

* Routing (moe_align_ref): the sorted ids are a permutation of the pairs plus pad rows, sorted by expert, each
  expert's segment padded to the M tile, every tile owned by one expert; sizes independent of the data.
* Property: the op against the fp64 per-expert loop for any routing (empty experts, every token on one
  expert, skewed, duplicate slots), top-k 1..8, up to 64 experts: relative error <= 1e-5 in fp32.
* opcheck, fake-vs-real metadata, errors naming the argument, torch.compile with fullgraph.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile import ops as ckvp_ops
from ckvp_compile.errors import CKVPShapeError
from ckvp_compile.kernels import moe_reference as moe_ref
from ckvp_compile.testing.moe_cases import make_moe_inputs, moe_routing_cases

ckvp_ops.register_all()
REL_FP32 = 1e-5


def assert_rel_close(actual: torch.Tensor, golden: torch.Tensor, rel: float) -> None:
    """Relative error in the max norm: max|actual - golden| <= rel * max(max|golden|, tiny)."""
    scale = golden.double().abs().max().clamp_min(1e-30)
    err = (actual.double() - golden.double()).abs().max()
    assert err <= rel * scale, f"relative error {float(err / scale):.3g} > {rel} (max|golden| {float(scale):.3g})"


def _args(x: dict) -> tuple:
    return x["hidden"], x["topk_ids"], x["topk_weights"], x["w_gate"], x["w_up"], x["w_down"]


# ------------------------------------------------------------------------------------------------ routing


@given(case=moe_routing_cases(), block_m=st.sampled_from([1, 4, 16, 64]))
def test_align_is_a_padded_permutation_sorted_by_expert(case, block_m):
    x = make_moe_inputs(case)
    ids = x["topk_ids"]
    e, p = case["num_experts"], ids.numel()
    sorted_ids, block_expert = moe_ref.moe_align_ref(ids, e, block_m)
    p_pad = moe_ref.padded_rows(p, e, block_m)
    assert sorted_ids.shape == (p_pad,) and block_expert.shape == (p_pad // block_m,)
    assert sorted_ids.dtype == block_expert.dtype == torch.int32
    real = sorted_ids[sorted_ids < p]
    assert sorted(real.tolist()) == list(range(p))  # every pair exactly once
    assert int((sorted_ids == p).sum()) == p_pad - p  # the rest are pad rows
    flat = ids.flatten()
    row_expert = block_expert.to(torch.int64).repeat_interleave(block_m)
    valid = sorted_ids < p
    assert torch.equal(row_expert[valid], flat[sorted_ids[valid].long()])  # each tile owns its pairs' expert
    owned = row_expert[valid]
    assert torch.equal(owned, owned.sort().values)  # ascending experts
    counts = torch.bincount(flat, minlength=e)
    used = block_expert[block_expert >= 0].long()
    assert torch.equal(torch.bincount(used, minlength=e), (counts + block_m - 1) // block_m)  # minimal padding
    assert bool((block_expert[len(used):] == moe_ref.PAD_EXPERT).all())  # empty tiles only at the end


def test_align_sizes_do_not_depend_on_the_routing():
    a = moe_ref.moe_align_ref(torch.zeros(5, 2, dtype=torch.long), 8, 16)
    b = moe_ref.moe_align_ref(torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 2]]), 8, 16)
    assert a[0].shape == b[0].shape == (moe_ref.padded_rows(10, 8, 16),)
    assert moe_ref.padded_rows(2, 8, 16) == 32  # decode, top-2: two tiles, not E tiles


# ------------------------------------------------------------------------------------------------ numerics


@given(case=moe_routing_cases(), fused=st.booleans())
def test_op_matches_per_expert_loop_fp32(case, fused):
    x = make_moe_inputs(case, fused_gate_up=fused)
    golden = moe_ref.moe_experts_loop_ref(*(t.double() if t.is_floating_point() else t for t in _args(x)))
    out = torch.ops.ckvp.moe_experts(*_args(x))
    assert out.shape == x["hidden"].shape and out.dtype == torch.float32
    assert_rel_close(out, golden, REL_FP32)


@given(case=moe_routing_cases(max_experts=16, max_tokens=24), block_m=st.sampled_from([1, 3, 16, 32]))
@settings(max_examples=6)
def test_grouped_path_is_independent_of_the_tile(case, block_m):
    x = make_moe_inputs(case)
    base = moe_ref.moe_experts_ref(*_args(x), block_m=16)
    torch.testing.assert_close(moe_ref.moe_experts_ref(*_args(x), block_m=block_m), base, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["random", "one_expert"])
def test_op_bf16_cpu(mode):
    case = dict(tokens=33, num_experts=8, top_k=2, hidden=64, ffn=40, mode=mode, seed=3)
    x = make_moe_inputs(case, dtype=torch.bfloat16)
    golden = moe_ref.moe_experts_loop_ref(*(t.double() if t.is_floating_point() else t for t in _args(x)))
    out = torch.ops.ckvp.moe_experts(*_args(x))
    assert out.dtype == torch.bfloat16
    assert_rel_close(out, golden, 1e-2)


def test_empty_batch():
    case = dict(tokens=1, num_experts=4, top_k=2, hidden=8, ffn=8, mode="random", seed=0)
    x = make_moe_inputs(case)
    x["hidden"], x["topk_ids"], x["topk_weights"] = x["hidden"][:0], x["topk_ids"][:0], x["topk_weights"][:0]
    assert torch.ops.ckvp.moe_experts(*_args(x)).shape == (0, 8)


# ------------------------------------------------------------------------------------------------ op contract


def test_opcheck_and_fake_metadata():
    case = dict(tokens=9, num_experts=6, top_k=3, hidden=16, ffn=24, mode="random", seed=1)
    x = make_moe_inputs(case)
    torch.library.opcheck(torch.ops.ckvp.moe_experts.default, _args(x))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ops.ckvp.moe_experts(*(mode.from_tensor(t) for t in _args(x)))
    real = torch.ops.ckvp.moe_experts(*_args(x))
    assert (fake.shape, fake.dtype, fake.device) == (real.shape, real.dtype, real.device)


@pytest.mark.parametrize("change, message", [
    (lambda x: x.update(hidden=x["hidden"][None]), "hidden must be 2-D"),
    (lambda x: x.update(topk_ids=x["topk_ids"][:-1]), "topk_ids must be (T, A)"),
    (lambda x: x.update(topk_ids=x["topk_ids"].float()), "int32 or int64"),
    (lambda x: x.update(topk_weights=x["topk_weights"][:, :1]), "topk_weights must be (T, A)"),
    (lambda x: x.update(w_gate=x["w_gate"][..., :-1]), "w_gate must be (E, I, Dm)"),
    (lambda x: x.update(w_up=x["w_up"][:, :-1]), "w_up must be (E, I, Dm)"),
    (lambda x: x.update(w_down=x["w_down"].transpose(1, 2)), "passed transposed"),
    (lambda x: x.update(w_down=x["w_down"].double()), "w_down must have hidden's dtype"),
    (lambda x: x.update(topk_ids=torch.zeros(5, 7, dtype=torch.long),
                        topk_weights=torch.ones(5, 7)), "top-k A = 7"),
])
def test_errors_name_the_argument(change, message):
    case = dict(tokens=5, num_experts=4, top_k=2, hidden=16, ffn=8, mode="random", seed=0)
    x = make_moe_inputs(case)
    change(x)
    with pytest.raises(CKVPShapeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        torch.ops.ckvp.moe_experts(*_args(x))


def test_triton_op_twin_on_cpu_calls_the_reference():
    """``ckvp::moe_experts_triton`` (the traceable twin the pass uses on CUDA) has the same contract; on CPU it
    computes with the reference, eagerly and compiled, and its opcheck passes."""
    case = dict(tokens=6, num_experts=5, top_k=2, hidden=16, ffn=24, mode="skewed", seed=3)
    x = make_moe_inputs(case)
    torch.library.opcheck(torch.ops.ckvp.moe_experts_triton.default, _args(x))
    want = torch.ops.ckvp.moe_experts(*_args(x))
    assert torch.equal(torch.ops.ckvp.moe_experts_triton(*_args(x)), want)
    f = torch.compile(lambda *a: torch.ops.ckvp.moe_experts_triton(*a), backend="aot_eager", fullgraph=True)
    assert torch.equal(f(*_args(x)), want)
    with pytest.raises(CKVPShapeError, match="w_down must be"):
        torch.ops.ckvp.moe_experts_triton(*_args(x)[:5], x["w_down"][:, :-1])


def test_compiles_fullgraph():
    case = dict(tokens=7, num_experts=5, top_k=2, hidden=16, ffn=24, mode="random", seed=2)
    x = make_moe_inputs(case)

    def f(hidden, ids, w, wg, wu, wd):
        return torch.ops.ckvp.moe_experts(hidden * 2, ids, w, wg, wu, wd) + 1

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(*_args(x))
    torch.testing.assert_close(out, f(*_args(x)))


# ------------------------------------------------------------------------------------------------ grouped_mm parts


def _routing(x: dict, case: dict, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    return moe_ref.moe_align_ref(x["topk_ids"], case["num_experts"], block_m)


@given(case=moe_routing_cases(), block_m=st.sampled_from([1, 3, 16, 64]))
def test_compact_routing_is_the_expert_sorted_pair_list(case, block_m):
    from ckvp_compile.kernels.moe_grouped_mm import compact_routing

    x = make_moe_inputs(case)
    sorted_ids, tile_expert = _routing(x, case, block_m)
    p, e = x["topk_ids"].numel(), case["num_experts"]
    rows, pairs, offs = compact_routing(sorted_ids, tile_expert, p, e, block_m)
    valid_rows = torch.nonzero(sorted_ids < p).flatten()
    assert torch.equal(rows, valid_rows)  # the valid padded rows, in order
    assert torch.equal(pairs, sorted_ids[valid_rows].long())
    assert sorted(pairs.tolist()) == list(range(p))
    counts = torch.bincount(x["topk_ids"].flatten(), minlength=e)
    assert offs.dtype == torch.int32 and torch.equal(offs.long(), counts.cumsum(0))  # group ends, empty groups too
    assert torch.equal(x["topk_ids"].flatten()[pairs], torch.repeat_interleave(torch.arange(e), counts))


@given(case=moe_routing_cases(), block_m=st.sampled_from([1, 4, 16, 64]))
def test_grouped_mm_parts_match_the_references_fp32(case, block_m):
    """gate/up equals the reference on every pair row; down equals it with NaN in every pad row of act (pad rows
    are never read); both chained equal the fp64 loop (empty experts, one expert, top-k 1..8, up to 64 experts)."""
    x = make_moe_inputs(case)
    sorted_ids, tile_expert = _routing(x, case, block_m)
    a, p = case["top_k"], x["topk_ids"].numel()
    act = torch.ops.ckvp.moe_gate_up_grouped_mm(x["hidden"], sorted_ids, tile_expert, x["w_gate"], x["w_up"], a,
                                                block_m)
    act_ref = moe_ref.grouped_gate_up_ref(x["hidden"], sorted_ids, tile_expert, x["w_gate"], x["w_up"], a, block_m)
    assert act.shape == act_ref.shape and act.dtype == act_ref.dtype and act.is_contiguous()
    valid = sorted_ids.long() < p
    assert_rel_close(act[valid], act_ref[valid], REL_FP32)
    assert not act[~valid].any()  # CPU: pad rows 0, as the reference (CUDA leaves them unwritten)
    poisoned = act_ref.clone()
    poisoned[~valid] = float("nan")
    pairs = torch.ops.ckvp.moe_down_grouped_mm(poisoned, sorted_ids, tile_expert, x["w_down"], x["topk_weights"],
                                               block_m)
    pairs_ref = moe_ref.grouped_down_ref(act_ref, sorted_ids, tile_expert, x["w_down"], x["topk_weights"], block_m)
    assert pairs.shape == pairs_ref.shape and pairs.dtype == torch.float32 and not pairs.isnan().any()
    assert_rel_close(pairs, pairs_ref, REL_FP32)
    act[~valid] = float("nan")  # whatever the gate/up op leaves in pad rows
    chained = torch.ops.ckvp.moe_down_grouped_mm(act, sorted_ids, tile_expert, x["w_down"], x["topk_weights"],
                                                 block_m).view(x["hidden"].shape[0], a, -1).sum(1)
    golden = moe_ref.moe_experts_loop_ref(*(t.double() if t.is_floating_point() else t for t in _args(x)))
    assert_rel_close(chained, golden, REL_FP32)


def test_grouped_mm_parts_bf16_cpu():
    case = dict(tokens=33, num_experts=8, top_k=2, hidden=64, ffn=40, mode="random", seed=4)
    x = make_moe_inputs(case, dtype=torch.bfloat16)
    sorted_ids, tile_expert = _routing(x, case, 16)
    act = torch.ops.ckvp.moe_gate_up_grouped_mm(x["hidden"], sorted_ids, tile_expert, x["w_gate"], x["w_up"], 2, 16)
    out = torch.ops.ckvp.moe_down_grouped_mm(act, sorted_ids, tile_expert, x["w_down"], x["topk_weights"], 16)
    golden = moe_ref.moe_experts_loop_ref(*(t.double() if t.is_floating_point() else t for t in _args(x)))
    assert act.dtype == torch.bfloat16
    assert_rel_close(out.view(33, 2, -1).sum(1), golden, 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_helper_follows_torch_grouped_mm_convention(dtype):
    """The loop the CPU path runs and ``torch._grouped_mm(x, W.transpose(-2, -1), offs)`` (the CUDA fast path)
    agree on CPU, empty groups included: the weight layout and the offsets mean the same to both."""
    from ckvp_compile.kernels.moe_grouped_mm import grouped_mm

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not in this torch")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(21, 16, generator=g).to(dtype)
    w = torch.randn(5, 24, 32, generator=g)[..., :16].to(dtype)  # (E, N, K) with a padded K stride
    offs = torch.tensor([4, 4, 13, 13, 21], dtype=torch.int32)
    want = grouped_mm(x, w, offs)
    try:
        got = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    except (RuntimeError, NotImplementedError) as exc:  # torch builds without a CPU kernel
        pytest.skip(f"torch._grouped_mm does not run on this CPU build: {exc}")
    torch.testing.assert_close(got, want, rtol=0 if dtype == torch.float32 else 1e-2, atol=1e-5)
    rows = [x[s:e] @ w[i].T for i, (s, e) in enumerate(zip([0, 4, 4, 13, 13], offs.tolist()))]
    torch.testing.assert_close(want, torch.cat(rows), rtol=1e-5, atol=1e-5)


def test_weight_operand_and_device_rules():
    from ckvp_compile.kernels.moe_grouped_mm import supports_grouped_mm, weight_operand_ok

    e, i, dm = 4, 24, 64
    gate_up = torch.empty(e, 2 * i, dm, dtype=torch.bfloat16)
    for w in (gate_up[:, :i], gate_up[:, i:], gate_up[:, :i].transpose(1, 2).contiguous().transpose(1, 2)):
        assert weight_operand_ok(tuple(w.shape), tuple(w.stride()), w.storage_offset(), 2)
    assert not weight_operand_ok((e, i, dm), (i * dm, dm, 1), 4, 2)  # offset of 8 bytes
    assert not weight_operand_ok((e, i, 60), (i * 60 + 4, 60, 1), 0, 2)  # 120-byte rows
    assert not weight_operand_ok((e, i, dm), (i * dm * 2, dm * 2, 2), 0, 2)  # no unit stride
    assert not weight_operand_ok((e, i, dm), (i * dm + 4, dm, 1), 0, 2)  # expert stride off by 8 bytes
    assert weight_operand_ok((e, i, 60), (i * 60, 60, 1), 0, 4)  # fp32: 240-byte rows are aligned
    cuda = torch.device("cuda", 0)
    assert supports_grouped_mm(cuda, torch.bfloat16, (9, 0)) and supports_grouped_mm(cuda, torch.bfloat16, (10, 0))
    assert not supports_grouped_mm(cuda, torch.float16, (9, 0))  # torch's per-group loop: a host sync
    assert not supports_grouped_mm(cuda, torch.bfloat16, (8, 0))
    assert not supports_grouped_mm(cuda, torch.bfloat16, None)
    assert not supports_grouped_mm(torch.device("cpu"), torch.bfloat16, (9, 0))


def test_grouped_mm_ops_opcheck_fake_and_errors():
    case = dict(tokens=9, num_experts=6, top_k=3, hidden=16, ffn=24, mode="skewed", seed=1)
    x = make_moe_inputs(case)
    sorted_ids, tile_expert = _routing(x, case, 4)
    up_args = (x["hidden"], sorted_ids, tile_expert, x["w_gate"], x["w_up"], 3, 4)
    torch.library.opcheck(torch.ops.ckvp.moe_gate_up_grouped_mm.default, up_args)  # CPU: pad rows are 0
    act = moe_ref.grouped_gate_up_ref(*up_args)
    down_args = (act, sorted_ids, tile_expert, x["w_down"], x["topk_weights"], 4)
    torch.library.opcheck(torch.ops.ckvp.moe_down_grouped_mm.default, down_args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    for op, args in ((torch.ops.ckvp.moe_gate_up_grouped_mm, up_args), (torch.ops.ckvp.moe_down_grouped_mm,
                                                                       down_args)):
        real = op(*args)
        with FakeTensorMode() as mode:
            fake = op(*(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args))
        assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())
    with pytest.raises(CKVPShapeError, match="moe_align"):
        torch.ops.ckvp.moe_gate_up_grouped_mm(*up_args[:6], 8)  # block_m 8 against a routing padded to 4
    with pytest.raises(CKVPShapeError, match="moe_align"):
        torch.ops.ckvp.moe_down_grouped_mm(act, sorted_ids[:-1], tile_expert, x["w_down"], x["topk_weights"], 4)


def test_grouped_mm_ops_empty_batch():
    x = make_moe_inputs(dict(tokens=1, num_experts=4, top_k=2, hidden=8, ffn=8, mode="random", seed=0))
    ids, w, h = x["topk_ids"][:0], x["topk_weights"][:0], x["hidden"][:0]
    sorted_ids, tile_expert = moe_ref.moe_align_ref(ids, 4, 16)
    act = torch.ops.ckvp.moe_gate_up_grouped_mm(h, sorted_ids, tile_expert, x["w_gate"], x["w_up"], 2, 16)
    assert act.shape == (0, 8)
    assert torch.ops.ckvp.moe_down_grouped_mm(act, sorted_ids, tile_expert, x["w_down"], w, 16).shape == (0, 8)
