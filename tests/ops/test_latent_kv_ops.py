"""Tests of the latent KV ops (ckvp_compile.ops.latent_kv) and their references (kernels/reference.py).

* RoPE: ``apply_rope_ref`` against independent implementations written as the models write them (HF
  ``apply_rotary_pos_emb``, GPT-J ``rotate_every_two`` + ``duplicate_interleave``, gpt-fast
  ``view_as_complex``), full and partial rotary.
* Round trip: rope_table_update + latent_append, then latent_reconstruct returns ``RoPE(P P^T x)`` at each
  slot's own position (per-sequence positions), current-call tokens exact, unwritten slots zero; at full rank
  the dense post-RoPE keys (exactly, bit for bit, with a signed-permutation basis).
* Attention: latent_attention equals torch SDPA over the K/V that latent_reconstruct rebuilds (GQA by repeat),
  with masks, kv_len < S_max, batch > 1, MHA/GQA/MQA, head dims 64 and 128.
* torch.library.opcheck of each op; shape errors; torch.compile (aot_eager, inductor) with fullgraph.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from ckvp_compile import ops as ckvp_ops
from ckvp_compile.errors import CKVPShapeError
from ckvp_compile.kernels import reference as ref

ckvp_ops.register_all()
OPS = torch.ops.ckvp
ROPE_FORMS = ("rotate_half", "interleaved", "complex")
ROPE_BASE = 10_000.0
P_MAX = 64  # RoPE positions the tables hold
FP32 = dict(atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------ independent RoPE (as the models write it)


def _angles(positions: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """(..., rotary_dim/2) fp64 angles position * inv_freq."""
    inv_freq = 1.0 / ROPE_BASE ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    return positions.double()[..., None] * inv_freq


def model_tables(form: str, rotary_dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin a model of this RoPE form feeds the ops at ``positions``: (..., W) fp32."""
    a = _angles(positions, rotary_dim)
    if form == "rotate_half":
        a = torch.cat((a, a), dim=-1)  # HF rotary_emb: emb = cat(freqs, freqs)
    elif form == "interleaved":
        a = a.repeat_interleave(2, dim=-1)  # GPT-J duplicate_interleave
    return a.cos().float(), a.sin().float()


def _hf_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(k, positions, rotary_dim):
    """HF ``apply_rotary_pos_emb`` (partial rotary as Phi / GPT-NeoX): k (B, Hkv, T, D), positions (B, T)."""
    freqs = _angles(positions, rotary_dim).float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    return torch.cat(((k_rot * cos) + (_hf_rotate_half(k_rot) * sin), k_pass), dim=-1)


def gptj_rope(k, positions, rotary_dim):
    """GPT-J ``apply_rotary_pos_emb`` with ``rotate_every_two`` and ``duplicate_interleave`` tables."""
    freqs = _angles(positions, rotary_dim).float()
    sin = torch.repeat_interleave(freqs.sin()[:, None], 2, dim=-1)
    cos = torch.repeat_interleave(freqs.cos()[:, None], 2, dim=-1)
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    x1, x2 = k_rot[..., ::2], k_rot[..., 1::2]
    every_two = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return torch.cat((k_rot * cos + every_two * sin, k_pass), dim=-1)


def gpt_fast_rope(k, positions, rotary_dim):
    """gpt-fast ``apply_rotary_emb``: adjacent pairs as complex numbers times ``freqs_cis``."""
    a = _angles(positions, rotary_dim)
    freqs_cis = torch.polar(torch.ones_like(a), a).to(torch.complex64)[:, None]  # (B, 1, T, rd/2)
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    kc = torch.view_as_complex(k_rot.float().reshape(*k_rot.shape[:-1], -1, 2))
    out = torch.view_as_real(kc * freqs_cis).flatten(-2)
    return torch.cat((out.type_as(k), k_pass), dim=-1)


INDEPENDENT_ROPE = {"rotate_half": hf_rope, "interleaved": gptj_rope, "complex": gpt_fast_rope,
                    "none": lambda k, positions, rotary_dim: k}


# ---------------------------------------------------------------------------------------------- group state


def offsets_of(ranks):
    return [0] + list(torch.tensor(ranks, dtype=torch.long).cumsum(0).tolist()) if ranks else [0]


def orthonormal_basis(hkv, gd, ranks, r_pad, permutation=False):
    """(Hkv, G*D, r_pad) fp32, head h's first r_h columns orthonormal (a signed permutation if asked), rest 0."""
    basis = torch.zeros(hkv, gd, r_pad)
    for h, r in enumerate(ranks):
        if permutation:
            q = torch.eye(gd, dtype=torch.float64)[torch.randperm(gd)] * (torch.randint(0, 2, (gd,)) * 2 - 1)
        else:
            q, _ = torch.linalg.qr(torch.randn(gd, gd, dtype=torch.float64))
        basis[h, :, :r] = q[:, :r].float()
    return basis


def project(x, basis, ranks):
    """P P^T x per head: x (B, Hkv, T, G*D) -> same, fp32."""
    out = torch.empty_like(x, dtype=torch.float32)
    for h, r in enumerate(ranks):
        p = basis[h, :, :r].float()
        out[:, h] = x[:, h].float() @ p @ p.T
    return out


class Group:
    """A group's latent cache after a sequence of calls (prefill, decode...) through the ops.

    Attributes: latent, cos_table, sin_table, slot_pos (the op state); x (B, Hkv, T, G*D) every written
    token's stacked pre-RoPE rows; positions (B, T) their RoPE positions (per-sequence start: left padding).
    """

    def __init__(self, *, b, hkv, g, d, s_max, ranks, r_pad, form, rotary_dim, latent_dtype=torch.float32,
                 permutation=False, with_tables=True):
        self.b, self.hkv, self.g, self.d, self.s_max = b, hkv, g, d, s_max
        self.ranks, self.offsets = list(ranks), offsets_of(ranks)
        self.form, self.rotary_dim = form, rotary_dim
        self.basis = orthonormal_basis(hkv, g * d, ranks, r_pad, permutation)
        self.latent = torch.zeros(b, s_max, self.offsets[-1], dtype=latent_dtype)
        w = ref.rope_table_width(form, rotary_dim)
        self.cos_table, self.sin_table = torch.zeros(P_MAX, w), torch.zeros(P_MAX, w)
        self.slot_pos = torch.zeros(b, s_max, dtype=torch.int32)
        self.start = torch.randint(0, 8, (b, 1))  # per-sequence first position
        self.x = torch.empty(b, hkv, 0, g * d)
        self.positions = torch.empty(b, 0, dtype=torch.long)
        self.with_tables = with_tables

    def call(self, n, x=None):
        """Append ``n`` new tokens at the next slots through rope_table_update + latent_append; return slots."""
        lo = self.x.shape[2]
        slots = torch.arange(lo, lo + n)
        pos = self.start + slots  # (B, n)
        x = torch.randn(self.b, self.hkv, n, self.g * self.d) if x is None else x
        if self.form != "none":
            cos, sin = model_tables(self.form, self.rotary_dim, pos)
            OPS.rope_table_update(self.cos_table, self.sin_table, self.slot_pos, cos, sin, pos, slots)
        OPS.latent_append(self.latent, x, self.basis, self.offsets, slots)
        self.x = torch.cat((self.x, x), dim=2)
        self.positions = torch.cat((self.positions, pos), dim=1)
        return slots

    def block(self, j):
        return self.basis[:, j * self.d : (j + 1) * self.d]

    def dense(self, j, x=None):
        """Layer j's exact post-RoPE keys of every written token (B, Hkv, T, D)."""
        x = self.x if x is None else x
        return INDEPENDENT_ROPE[self.form](x[..., j * self.d : (j + 1) * self.d], self.positions, self.rotary_dim)

    def reconstruct(self, j, new, slots):
        return OPS.latent_reconstruct(self.latent, self.block(j), self.offsets, self.cos_table, self.sin_table,
                                      self.slot_pos, self.form, self.rotary_dim, new, slots)


@st.composite
def group_shapes(draw, forms=("none",) + ROPE_FORMS, head_dims=(8, 16, 32)):
    d = draw(st.sampled_from(head_dims))
    g = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 3))
    form = draw(st.sampled_from(forms))
    rotary_dim = draw(st.sampled_from([d, d // 2, 2])) if form != "none" else 0
    ranks = [draw(st.integers(0, g * d)) for _ in range(hkv)]
    r_pad = max(ranks) + draw(st.integers(0, 2))
    s_max = draw(st.integers(3, 12))
    return dict(b=draw(st.integers(1, 3)), hkv=hkv, g=g, d=d, s_max=s_max, ranks=ranks, r_pad=r_pad, form=form,
                rotary_dim=rotary_dim)


# --------------------------------------------------------------------------------------------------- tests


def test_register_all_is_idempotent():
    first = ckvp_ops.register_all()
    assert first == ckvp_ops.register_all()
    latent = ["ckvp::latent_append", "ckvp::latent_attention", "ckvp::latent_reconstruct", "ckvp::online_basis_fit",
              "ckvp::rope_table_update"]
    assert set(latent) <= set(first) and first == sorted(first)
    for name in latent:
        assert hasattr(OPS, name.split("::")[1])


def test_reference_does_not_import_triton():
    import pathlib

    assert "triton" not in pathlib.Path(ref.__file__).read_text().replace("no Triton", "")


@pytest.mark.parametrize("form", ROPE_FORMS)
@pytest.mark.parametrize("d, rotary_dim", [(16, 16), (16, 8), (32, 8), (8, 2)])
def test_apply_rope_matches_the_models(form, d, rotary_dim):
    positions = torch.randint(0, 500, (2, 5))
    k = torch.randn(2, 3, 5, d)
    cos, sin = model_tables(form, rotary_dim, positions)
    got = ref.apply_rope_ref(k, cos[:, None], sin[:, None], form, rotary_dim)
    torch.testing.assert_close(got, INDEPENDENT_ROPE[form](k, positions, rotary_dim), **FP32)
    torch.testing.assert_close(got[..., rotary_dim:], k[..., rotary_dim:], atol=0, rtol=0)


@given(shape=group_shapes())
def test_append_reconstruct_round_trip(shape):
    grp = Group(**shape)
    n_prefill = torch.randint(1, shape["s_max"], ()).item()
    n_new = torch.randint(1, shape["s_max"] - n_prefill + 1, ()).item()
    grp.call(n_prefill)
    slots = grp.call(n_new)
    written = n_prefill + n_new
    proj = project(grp.x, grp.basis, grp.ranks)  # P P^T x
    for j in range(shape["g"]):
        new = grp.dense(j)[:, :, slots]  # the current call's exact post-RoPE keys
        got = grp.reconstruct(j, new, slots)
        assert got.shape == (shape["b"], shape["hkv"], shape["s_max"], shape["d"]) and got.dtype == new.dtype
        want = grp.dense(j, proj)
        want[:, :, slots] = new
        torch.testing.assert_close(got[:, :, :written], want, atol=1e-4, rtol=1e-4)
        assert not got[:, :, written:].any(), "unwritten slots must rebuild to zero"


@pytest.mark.parametrize("form", ("none",) + ROPE_FORMS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_full_rank_rebuilds_the_dense_keys(form, dtype):
    """r = G*D: an orthonormal basis rebuilds the dense keys to the latent's precision, a signed permutation
    bit for bit."""
    g, d = 2, 16
    shape = dict(b=2, hkv=2, g=g, d=d, s_max=9, ranks=[g * d, g * d], r_pad=g * d, form=form,
                 rotary_dim=0 if form == "none" else d, latent_dtype=dtype)
    tol = {torch.float32: FP32, torch.bfloat16: dict(atol=4e-2, rtol=2e-2),
           torch.float16: dict(atol=5e-3, rtol=5e-3)}[dtype]
    for permutation in (False, True):
        grp = Group(**shape, permutation=permutation)
        grp.call(5, torch.randn(2, 2, 5, g * d).to(dtype).float())  # values representable in the latent dtype
        slots = grp.call(3, torch.randn(2, 2, 3, g * d).to(dtype).float())
        for j in range(g):
            dense = grp.dense(j)
            got = grp.reconstruct(j, dense[:, :, slots].to(dtype), slots)[:, :, :8]
            assert got.dtype == dtype
            if permutation and form == "none":
                torch.testing.assert_close(got, dense.to(dtype), atol=0, rtol=0)
            elif permutation:  # pre-RoPE exact; RoPE in fp32 then one rounding to dtype
                torch.testing.assert_close(got.float(), dense, **(FP32 if dtype == torch.float32 else
                                                                  dict(atol=1e-2, rtol=1e-2)))
            else:
                torch.testing.assert_close(got.float(), dense, **tol)


def test_rope_table_update_writes_positions_per_sequence():
    cos_table, sin_table = torch.zeros(P_MAX, 8), torch.zeros(P_MAX, 8)
    slot_pos = torch.full((2, 6), -1, dtype=torch.int32)
    pos = torch.tensor([[3, 4, 5], [0, 1, 2]])  # left padding: sequence 0 starts later
    cos, sin = model_tables("rotate_half", 8, pos)
    OPS.rope_table_update(cos_table, sin_table, slot_pos, cos, sin, pos, torch.tensor([2, 3, 4]))
    assert slot_pos.tolist() == [[-1, -1, 3, 4, 5, -1], [-1, -1, 0, 1, 2, -1]]
    full_cos, full_sin = model_tables("rotate_half", 8, torch.arange(6))
    torch.testing.assert_close(cos_table[:6], full_cos, atol=0, rtol=0)
    torch.testing.assert_close(sin_table[:6], full_sin, atol=0, rtol=0)
    assert not cos_table[6:].any()
    # (1, S) tables and positions broadcast over the batch
    OPS.rope_table_update(cos_table, sin_table, slot_pos, *model_tables("rotate_half", 8, pos[:1, :1]), pos[:1, :1],
                          torch.tensor([5]))
    assert slot_pos[:, 5].tolist() == [3, 3]


def _attention_case(*, b, h, hkv, d, g, s_max, n_past, n_new, kv_len, form, rotary_dim, k_ranks, v_ranks,
                    mask_kind, j=0, q_dtype=torch.float32, n_win=0, n_unused=0):
    """Run a prefill + current call through the ops; return (latent_attention output, SDPA over the
    reconstructed dense K/V). ``n_win`` past slots are exact too (a recent window kept dense), and ``n_unused``
    exact-token entries are -1 (unused ring entries, with garbage values that must not count)."""
    kg = Group(b=b, hkv=hkv, g=g, d=d, s_max=s_max, ranks=k_ranks, r_pad=max(k_ranks) + 1, form=form,
               rotary_dim=rotary_dim)
    vg = Group(b=b, hkv=hkv, g=g, d=d, s_max=s_max, ranks=v_ranks, r_pad=max(v_ranks), form="none", rotary_dim=0)
    vg.start = kg.start
    for grp in (kg, vg):
        grp.call(n_past)
        grp.call(n_new)
    slots = torch.arange(n_past, n_past + n_new)
    kg.latent[:, kv_len:] = float("nan")  # beyond kv_len: never read
    vg.latent[:, kv_len:] = float("nan")
    new_k, new_v = kg.dense(j)[:, :, slots], vg.x[:, :, slots, j * d : (j + 1) * d]
    n_win = min(n_win, n_past)
    if n_win or n_unused:
        win = torch.randperm(n_past)[:n_win]
        slots = torch.cat((win, torch.full((n_unused,), -1), slots))
        new_k = torch.cat((torch.randn(b, hkv, n_win + n_unused, d), new_k), 2)
        new_v = torch.cat((torch.randn(b, hkv, n_win + n_unused, d), new_v), 2)
    q = torch.randn(b, h, n_new, d).to(q_dtype)
    scale = 0.7 / math.sqrt(d)
    # left padding + causal: query i (slot n_past + i) attends to slots [pad_b, n_past + i]
    t, i = torch.arange(kv_len), torch.arange(n_new)
    pad = torch.randint(0, n_past, (b, 1, 1, 1))
    allowed = (t[None, None, None, :] <= n_past + i[None, None, :, None]) & (t >= pad)  # (B, 1, S, kv_len)
    mask = {
        "none": None,
        "bool": allowed,
        "bool_bh": allowed.expand(b, h, n_new, kv_len).clone(),
        "bool_2d": allowed[0, 0],
        "float": torch.where(allowed, torch.randn(b, 1, n_new, kv_len), float("-inf")),
    }[mask_kind]
    got = OPS.latent_attention(q, kg.latent, vg.latent, kg.block(j), vg.block(j), kg.offsets, vg.offsets,
                               kg.cos_table, kg.sin_table, kg.slot_pos, form, rotary_dim, new_k, new_v, slots, mask,
                               scale, kv_len)
    used = slots >= 0  # the oracle drops unused entries on the host (the ops must ignore them on their own)
    k_dense = kg.reconstruct(j, new_k[:, :, used], slots[used])[:, :, :kv_len]
    v_dense = vg.reconstruct(j, new_v[:, :, used], slots[used])[:, :, :kv_len]
    n_rep = h // hkv
    want = F.scaled_dot_product_attention(q.float(), k_dense.repeat_interleave(n_rep, 1),
                                          v_dense.repeat_interleave(n_rep, 1), attn_mask=mask, scale=scale)
    return got, want


@given(data=st.data())
def test_latent_attention_equals_sdpa_over_reconstruction(data):
    d = data.draw(st.sampled_from((8, 16, 32)))
    hkv = data.draw(st.sampled_from((1, 2, 3)))
    h = hkv * data.draw(st.sampled_from((1, 2, 4)))  # MHA, GQA, MQA (hkv == 1)
    g = data.draw(st.integers(1, 3))
    s_max = data.draw(st.integers(4, 12))
    n_past = data.draw(st.integers(1, s_max - 2))
    n_new = data.draw(st.integers(1, s_max - n_past - 1))
    kv_len = data.draw(st.integers(n_past + n_new, s_max))
    form = data.draw(st.sampled_from(("none",) + ROPE_FORMS))
    rotary_dim = 0 if form == "none" else data.draw(st.sampled_from((d, d // 2)))
    k_ranks = [data.draw(st.integers(1, g * d)) for _ in range(hkv)]
    v_ranks = [data.draw(st.integers(1, g * d)) for _ in range(hkv)]
    got, want = _attention_case(
        b=data.draw(st.integers(1, 3)), h=h, hkv=hkv, d=d, g=g, s_max=s_max, n_past=n_past, n_new=n_new,
        kv_len=kv_len, form=form, rotary_dim=rotary_dim, k_ranks=k_ranks, v_ranks=v_ranks,
        mask_kind=data.draw(st.sampled_from(("none", "bool", "bool_bh", "bool_2d", "float"))),
        j=data.draw(st.integers(0, g - 1)), n_win=data.draw(st.sampled_from((0, 1, 5))),
        n_unused=data.draw(st.sampled_from((0, 2))))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("d, h, hkv, form", [(64, 8, 2, "rotate_half"), (128, 4, 1, "complex"),
                                             (128, 4, 4, "interleaved")])
def test_latent_attention_large_head_dims(d, h, hkv, form):
    got, want = _attention_case(b=2, h=h, hkv=hkv, d=d, g=2, s_max=16, n_past=9, n_new=3, kv_len=14, form=form,
                                rotary_dim=d, k_ranks=[d // 2 + 7 * i for i in range(hkv)], v_ranks=[d] * hkv,
                                mask_kind="bool", j=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_latent_attention_output_dtype_and_dead_rows():
    got, want = _attention_case(b=2, h=4, hkv=2, d=16, g=2, s_max=8, n_past=4, n_new=2, kv_len=8, form="rotate_half",
                                rotary_dim=16, k_ranks=[8, 12], v_ranks=[16, 4], mask_kind="none",
                                q_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    # a query row the mask removes entirely attends to nothing: 0, as torch SDPA gives
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[..., 1, :] = False
    out = ref.sdpa_ref(q, k, v, mask)
    assert out[:, :, 1].eq(0).all() and out.isfinite().all()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k.expand(1, 2, 5, 8), v.expand(1, 2, 5, 8),
                                                                   attn_mask=mask), **FP32)


# -------------------------------------------------------------------------------------- opcheck and errors


def _op_args():
    """One (op, args) per op and variant, on a small state with partial ranks and per-sequence positions."""
    b, hkv, h, g, d, s_max = 2, 2, 4, 2, 8, 6
    cases = []
    for form in ROPE_FORMS:
        kg = Group(b=b, hkv=hkv, g=g, d=d, s_max=s_max, ranks=[5, 3], r_pad=6, form=form, rotary_dim=d // 2)
        kg.call(3)
        vg = Group(b=b, hkv=hkv, g=g, d=d, s_max=s_max, ranks=[4, 0], r_pad=4, form="none", rotary_dim=0)
        vg.call(3)
        slots = torch.tensor([3, 4])
        pos = kg.start + slots
        cos, sin = model_tables(form, d // 2, pos)
        new_k, new_v, q = torch.randn(b, hkv, 2, d), torch.randn(b, hkv, 2, d), torch.randn(b, h, 2, d)
        cases += [
            (OPS.rope_table_update, (kg.cos_table, kg.sin_table, kg.slot_pos, cos, sin, pos, slots)),
            (OPS.latent_append, (kg.latent, torch.randn(b, hkv, 2, g * d), kg.basis, kg.offsets, slots)),
            (OPS.latent_reconstruct, (kg.latent, kg.block(1), kg.offsets, kg.cos_table, kg.sin_table, kg.slot_pos,
                                      form, d // 2, new_k, slots)),
        ]
        for mask in (None, torch.ones(1, 1, 2, 5, dtype=torch.bool), torch.zeros(b, h, 2, 5)):
            cases.append((OPS.latent_attention, (q, kg.latent, vg.latent, kg.block(0), vg.block(0), kg.offsets,
                                                 vg.offsets, kg.cos_table, kg.sin_table, kg.slot_pos, form, d // 2,
                                                 new_k, new_v, slots, mask, d**-0.5, 5)))
    cases.append((OPS.latent_reconstruct, (vg.latent, vg.block(0), vg.offsets, torch.empty(0), torch.empty(0),
                                           torch.empty(0, dtype=torch.int32), "none", 0, new_v, slots)))
    # exact tokens of a recent window: N = 4 entries for 2 queries, one unused (-1); and the ring's append
    ex_slots = torch.tensor([-1, 1, 3, 4])
    ex_k, ex_v = torch.randn(b, hkv, 4, d), torch.randn(b, hkv, 4, d)
    cases.append((OPS.latent_attention, (q, kg.latent, vg.latent, kg.block(0), vg.block(0), kg.offsets, vg.offsets,
                                         kg.cos_table, kg.sin_table, kg.slot_pos, form, d // 2, ex_k, ex_v, ex_slots,
                                         None, d**-0.5, 5)))
    cases.append((OPS.window_append, (torch.zeros(b, hkv, 3, d), torch.zeros(b, hkv, 3, d),
                                      torch.full((3,), -1, dtype=torch.int64), new_k, new_v, slots)))
    return cases


@pytest.mark.parametrize("case", range(len(_op_args())))
def test_opcheck(case):
    torch.manual_seed(case)
    op, args = _op_args()[case]
    torch.library.opcheck(op, args)


def _bad_inputs():
    b, hkv, g, d = 2, 2, 2, 8
    latent, basis = torch.zeros(b, 6, 8), torch.zeros(hkv, g * d, 4)
    x, slots = torch.zeros(b, hkv, 3, g * d), torch.arange(3)
    table, slot_pos = torch.zeros(P_MAX, d), torch.zeros(b, 6, dtype=torch.int32)
    new, q = torch.zeros(b, hkv, 3, d), torch.zeros(b, 4, 3, d)
    blk = basis[:, :d]
    att = lambda **kw: (OPS.latent_attention, {**dict(  # noqa: E731
        q=q, latent_k=latent, latent_v=latent, basis_k_block=blk, basis_v_block=blk, k_offsets=[0, 4, 8],
        v_offsets=[0, 4, 8], cos_table=table, sin_table=table, slot_pos=slot_pos, rope_form="rotate_half",
        rotary_dim=d, new_k=new, new_v=new, slots=slots, attn_mask=None, scale=1.0, kv_len=6), **kw})
    return {
        "append_x": (OPS.latent_append, dict(latent=latent, x=x[..., :d], basis=basis, offsets=[0, 4, 8], slots=slots),
                     r"x must be \(B, Hkv, S, G\*D\) .* = \(2, 2, 3, 16\), but got \(2, 2, 3, 8\)"),
        "append_offsets": (OPS.latent_append, dict(latent=latent, x=x, basis=basis, offsets=[0, 4, 7], slots=slots),
                           r"offsets\[-1\] must equal the latent width R_tot = 8, but got 7"),
        "append_rank": (OPS.latent_append, dict(latent=latent, x=x, basis=basis, offsets=[0, 5, 8], slots=slots),
                        r"rank \[5, 3\] .* must be <= the basis width R_max = 4"),
        "append_slots_dtype": (OPS.latent_append, dict(latent=latent, x=x, basis=basis, offsets=[0, 4, 8],
                                                       slots=slots.float()), r"slots must be int32 or int64"),
        "table_width": (OPS.latent_reconstruct, dict(latent=latent, basis_block=blk, offsets=[0, 4, 8],
                                                     cos_table=table, sin_table=table, slot_pos=slot_pos,
                                                     rope_form="complex", rotary_dim=d, new=new, slots=slots),
                        r"cos_table must be \(P_max, W\) with W = 4 for 'complex' = \(\*, 4\), but got \(64, 8\)"),
        "rope_form": (OPS.latent_reconstruct, dict(latent=latent, basis_block=blk, offsets=[0, 4, 8],
                                                   cos_table=table, sin_table=table, slot_pos=slot_pos,
                                                   rope_form="neox", rotary_dim=d, new=new, slots=slots),
                      r"rope_form must be one of"),
        "update_batch": (OPS.rope_table_update, dict(cos_table=table, sin_table=table, slot_pos=slot_pos,
                                                     cos=torch.zeros(3, 3, d), sin=torch.zeros(3, 3, d),
                                                     position_ids=torch.zeros(1, 3, dtype=torch.long), slots=slots),
                         r"cos must be \(B or 1, S, W\) with B = 2"),
        "attn_heads": (*att(q=torch.zeros(b, 3, 3, d)),
                       r"query heads H = 3 \(q.shape\[1\]\) must be a multiple of the KV heads Hkv = 2"),
        "attn_kv_len": (*att(kv_len=7), r"kv_len must be in \[1, S_max = 6\]"),
        "attn_mask": (*att(attn_mask=torch.ones(b, 4, 3, 6 + 1, dtype=torch.bool)),
                      r"attn_mask must be broadcastable to \(B, H, S, kv_len\) = \(2, 4, 3, 6\), but got \(2, 4, 3, 7\)"),
        "attn_mask_dtype": (*att(attn_mask=torch.ones(1, 1, 3, 6, dtype=torch.long)), r"bool .* or an additive float"),
    }


@pytest.mark.parametrize("name", sorted(_bad_inputs()))
def test_shape_errors_name_expected_and_actual(name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, kwargs, pattern = _bad_inputs()[name]
    with pytest.raises(CKVPShapeError, match=pattern):
        op(**kwargs)
    with FakeTensorMode() as mode:  # the fake kernel checks the same at trace time
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with pytest.raises(CKVPShapeError, match=pattern):
            op(**fake)


# --------------------------------------------------------------------------------------------- torch.compile


def _decode_step(basis_k, basis_v, offsets, d, form, rotary_dim, kv_len):
    def step(latent_k, latent_v, cos_table, sin_table, slot_pos, x_k, x_v, cos, sin, pos, slots, q, mask):
        OPS.rope_table_update(cos_table, sin_table, slot_pos, cos, sin, pos, slots)
        OPS.latent_append(latent_k, x_k, basis_k, offsets, slots)
        OPS.latent_append(latent_v, x_v, basis_v, offsets, slots)
        new_k = ref.apply_rope_ref(x_k[..., :d], cos[:, None], sin[:, None], form, rotary_dim)
        return OPS.latent_attention(q, latent_k, latent_v, basis_k[:, :d], basis_v[:, :d], offsets, offsets,
                                    cos_table, sin_table, slot_pos, form, rotary_dim, new_k, x_v[..., :d], slots,
                                    mask, d**-0.5, kv_len)

    return step


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _to(obj, device):
    return obj.to(device) if isinstance(obj, torch.Tensor) else obj


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("case", range(len(_op_args())))
def test_cuda_matches_cpu(case):
    op, args = _op_args()[case]
    cpu_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    cuda_args = [_to(a, "cuda") for a in args]
    want, got = op(*cpu_args), op(*cuda_args)
    if want is not None:
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    for a, b in zip(cpu_args, cuda_args):  # mutated state agrees
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(b.cpu(), a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_ops_under_torch_compile(backend, device):
    b, hkv, h, g, d, s_max, form = 2, 2, 4, 2, 8, 6, "rotate_half"
    grp = Group(b=b, hkv=hkv, g=g, d=d, s_max=s_max, ranks=[6, 4], r_pad=6, form=form, rotary_dim=d)
    vgrp = Group(b=b, hkv=hkv, g=g, d=d, s_max=s_max, ranks=[6, 4], r_pad=6, form="none", rotary_dim=0)
    vgrp.basis = grp.basis
    grp.call(3)
    vgrp.call(3)
    slots = torch.tensor([3])
    pos = grp.start + slots
    cos, sin = model_tables(form, d, pos)
    x_k, x_v, q = torch.randn(b, hkv, 1, g * d), torch.randn(b, hkv, 1, g * d), torch.randn(b, h, 1, d)
    mask = torch.ones(b, 1, 1, 4, dtype=torch.bool)
    x_k, x_v, q, mask, cos, sin, pos, slots = (t.to(device) for t in (x_k, x_v, q, mask, cos, sin, pos, slots))
    step = _decode_step(grp.basis.to(device), grp.basis.to(device), grp.offsets, d, form, d, kv_len=4)
    state = tuple(t.to(device) for t in (grp.latent, vgrp.latent, grp.cos_table, grp.sin_table, grp.slot_pos))
    eager_state = [t.clone() for t in state]
    compiled_state = [t.clone() for t in state]
    want = step(*eager_state, x_k, x_v, cos, sin, pos, slots, q, mask)
    got = torch.compile(step, backend=backend, fullgraph=True)(*compiled_state, x_k, x_v, cos, sin, pos, slots, q,
                                                                mask)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for e, c in zip(eager_state, compiled_state):
        torch.testing.assert_close(c, e, atol=0, rtol=0)  # every mutation visible after the compiled call
    assert not torch.equal(compiled_state[0], state[0]), "latent_k must have been written"
    assert compiled_state[4][:, 3].tolist() == pos[:, 0].tolist()


def test_unused_exact_entries_are_never_read_and_slots_stay_inside_kv_len():
    """Entries marked -1 (a recent window's empty ring) may hold anything, NaN and inf included: the output is the
    one with them zeroed. An exact token at a slot >= kv_len would not be attended: a clear error on host tensors."""
    from ckvp_compile.errors import CKVPShapeError

    torch.manual_seed(0)
    kg = Group(b=1, hkv=2, g=1, d=8, s_max=10, ranks=[3, 4], r_pad=5, form="rotate_half", rotary_dim=8)
    vg = Group(b=1, hkv=2, g=1, d=8, s_max=10, ranks=[2, 4], r_pad=4, form="none", rotary_dim=0)
    vg.start = kg.start
    for grp in (kg, vg):
        grp.call(6)
    q = torch.randn(1, 4, 1, 8)
    slots = torch.tensor([-1, 2, 5, -1])
    nk, nv = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)

    def run(k, v, sl=slots, kv_len=6):
        return OPS.latent_attention(q, kg.latent, vg.latent, kg.block(0), vg.block(0), kg.offsets, vg.offsets,
                                    kg.cos_table, kg.sin_table, kg.slot_pos, "rotate_half", 8, k, v, sl, None, 0.3,
                                    kv_len)

    clean = run(nk.masked_fill((slots < 0)[:, None], 0.0), nv.masked_fill((slots < 0)[:, None], 0.0))
    dirty_k, dirty_v = nk.clone(), nv.clone()
    dirty_k[:, :, 0], dirty_v[:, :, 0], dirty_v[:, :, 3] = float("nan"), float("inf"), float("nan")
    torch.testing.assert_close(run(dirty_k, dirty_v), clean)
    with pytest.raises(CKVPShapeError, match="kv_len"):
        run(nk, nv, torch.tensor([-1, 2, 6, -1]))
