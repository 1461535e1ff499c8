"""``analysis.rope.rope_residue``: is the cached key exactly RoPE of the pre-RoPE key (what a latent cache rebuilds)?

Each case is a small function of a key (1, 2, 5, 16) and its RoPE angles, captured with Dynamo
(:func:`capture_dynamo_graphs`, as ``test_rope_paired.py`` does); :func:`match_rope` reads its output and
:func:`rope_residue` judges it. The forms marked *gap* pass the structural check alone (``_rope_residue``); the
proof by evaluation must refuse them. The forms marked *exact, refused by structure* are exact rotations the
structural check refuses; the evaluation must accept them.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from ckvp_compile.analysis import rope as rope_mod
from ckvp_compile.analysis.attention import find_attention_sites
from ckvp_compile.analysis.graph import strip_views
from ckvp_compile.analysis.rope import match_rope, rope_residue
from ckvp_compile.testing.decoding import capture_dynamo_graphs, capture_prefill_decode_graphs
from ckvp_compile.testing.models import build_hf_moe

D, H = 16, 8
X = torch.randn(1, 2, 5, D, generator=torch.Generator().manual_seed(1))
ANG = torch.rand(5, H, generator=torch.Generator().manual_seed(2)) * 6 - 3  # one angle per rotated pair


def _paired(ang):
    """HF's tables, (S, D): ``cat((freqs, freqs), -1)`` then cos / sin (paired by construction)."""
    emb = torch.cat((ang, ang), -1)
    return emb.cos(), emb.sin()


def _rh(x):
    return torch.cat((-x[..., H:], x[..., :H]), -1)


def _halves(x):
    return x[..., :H], x[..., H:]


def _inter(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)


def _hf(x, c, s):
    return x * c + _rh(x) * s


def _written_out(x, c, s):  # cat(x1*c - x2*s, x2*c + x1*s) with half tables
    (x1, x2), c1, s1 = _halves(x), c[..., :H], s[..., :H]
    return torch.cat((x1 * c1 - x2 * s1, x2 * c1 + x1 * s1), -1)


def _table_halves(x, c, s):  # each half of the key with its own half of the table: exact only for paired tables
    x1, x2 = _halves(x)
    return torch.cat((x1 * c[..., :H] - x2 * s[..., :H], x2 * c[..., H:] + x1 * s[..., H:]), -1)


def _complex(x, ang, negate=False):
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], H, 2))
    y = xc * torch.polar(torch.ones_like(ang), ang)
    return torch.view_as_real(-y if negate else y).flatten(-2)


ROTATE_HALF = {
    # exact
    "hf": _hf,
    "written_out": _written_out,
    "table_halves_paired": _table_halves,
    # exact, refused by structure (a sign flip around the subtraction that combines the terms)
    "neg_around_sub_halves": lambda x, c, s: torch.cat(
        (-(_halves(x)[1] * s[..., :H] - _halves(x)[0] * c[..., :H]),
         _halves(x)[1] * c[..., :H] + _halves(x)[0] * s[..., :H]), -1),
    "neg_around_sub": lambda x, c, s: -(torch.cat((x[..., H:], -x[..., :H]), -1) * s - x * c),
    "times_minus_one_around_sub": lambda x, c, s: (torch.cat((x[..., H:], -x[..., :H]), -1) * s - x * c) * -1,
    # gaps: not RoPE, passed by the structure
    "inverse": lambda x, c, s: x * c - _rh(x) * s,
    "neg_before_add": lambda x, c, s: -(x * c) + _rh(x) * s,
    "neg_term": lambda x, c, s: x * c + -(_rh(x) * s),
    "swapped_factors": lambda x, c, s: torch.cat(
        (_halves(x)[0] * c[..., :H] - _halves(x)[1] * s[..., :H],
         _halves(x)[1] * s[..., :H] + _halves(x)[0] * c[..., :H]), -1),
    "repeated_table": lambda x, c, s: x * c * c + _rh(x) * s,
    "extra_term": lambda x, c, s: x * c + _rh(x) * s + x * s,
    "permuted": lambda x, c, s: (lambda y: torch.cat((y[..., H:], y[..., :H]), -1))(_hf(x, c, s)),
}
EXACT = {"hf", "written_out", "table_halves_paired"}
EXACT_REFUSED_BY_STRUCTURE = {"neg_around_sub_halves", "neg_around_sub", "times_minus_one_around_sub"}
GAPS = set(ROTATE_HALF) - EXACT - EXACT_REFUSED_BY_STRUCTURE


def _match(fn, *args):
    """The RopeMatch of the key ``fn`` returns, in its Dynamo graph."""
    (gm,) = capture_dynamo_graphs(fn, *args)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    m = match_rope(strip_views(out[0] if isinstance(out, (tuple, list)) else out))
    assert m is not None
    return m


def _rotate_half_match(name):
    fn = ROTATE_HALF[name]
    return _match(lambda x, ang: fn(x, *_paired(ang)), X, ANG)


@pytest.mark.parametrize("name", sorted(ROTATE_HALF))
def test_rotate_half_forms(name):
    m = _rotate_half_match(name)
    assert m.form == "rotate_half" and m.x_in.op == "placeholder"
    structural = rope_mod._rope_residue(m)
    residue = rope_residue(m)
    if name in EXACT:
        assert structural is None and residue is None
    elif name in EXACT_REFUSED_BY_STRUCTURE:
        assert structural is not None and "flips the sign" in structural
        assert residue is None, residue
    else:
        assert name in GAPS and structural is None, f"{name} is no gap of the structural check: {structural}"
        assert residue is not None and "is not the rotation of" in residue and m.out.name in residue


@pytest.mark.parametrize("name, exact", [("interleaved", True), ("interleaved_inverse", False),
                                          ("interleaved_neg_before_add", False)])
def test_interleaved_forms(name, exact):
    def fn(x, ang):
        c, s = ang.repeat_interleave(2, -1).cos(), ang.repeat_interleave(2, -1).sin()
        if name == "interleaved_inverse":
            return x * c - _inter(x) * s
        if name == "interleaved_neg_before_add":
            return -(x * c) + _inter(x) * s
        return x * c + _inter(x) * s

    m = _match(fn, X, ANG)
    assert m.form == "interleaved" and rope_mod._rope_residue(m) is None
    assert (rope_residue(m) is None) is exact


@pytest.mark.parametrize("negate", [False, True])
def test_complex_form_sign_flip(negate):
    """A sign flip of the complex product (a gap of the structural check, which has no add to anchor it on)."""
    m = _match(lambda x, ang: _complex(x, ang, negate), X, ANG)
    assert m.form == "complex" and rope_mod._rope_residue(m) is None
    residue = rope_residue(m)
    assert residue is None if not negate else "is not the rotation of" in residue


def test_table_halves_need_proven_paired_tables():
    """``cat(x1*c[:h] - x2*s[:h], x2*c[h:] + x1*s[h:])`` is RoPE only when each table's halves are equal: proven for
    tables built in the graph as ``cat((f, f))``, not for tables that are graph inputs (then refused)."""
    paired = _match(lambda x, ang: _table_halves(x, *_paired(ang)), X, ANG)
    assert rope_residue(paired) is None
    c, s = _paired(ANG)
    inputs = _match(_table_halves, X, c, s)
    assert rope_mod._rope_residue(inputs) is None
    assert "is not the rotation of" in rope_residue(inputs)


@pytest.mark.parametrize("name", ["hf", "inverse", "neg_around_sub"])
def test_no_proof_leaves_the_structural_answer(name, monkeypatch):
    """When the region cannot be evaluated (here: no recorded value for the pre-RoPE key, or the run raising), the
    structural answer stands, and nothing raises."""
    m = _rotate_half_match(name)
    structural = rope_mod._rope_residue(m)
    val = m.x_in.meta.pop("example_value")
    try:
        assert rope_mod._rope_proof(m) is None
        assert rope_residue(m) == structural
    finally:
        m.x_in.meta["example_value"] = val

    def boom(program):
        raise RuntimeError("boom")

    with monkeypatch.context() as patch:
        patch.setattr(rope_mod, "_run_program", boom)
        rope_mod._PROOFS.clear()
        assert rope_mod._rope_proof(m) is None and rope_residue(m) == structural
    with monkeypatch.context() as patch:  # a key over the size limit is not evaluated
        patch.setattr(rope_mod, "_EVAL_MAX_ELEMENTS", X.numel() - 1)
        rope_mod._PROOFS.clear()
        assert rope_mod._rope_proof(m) is None and rope_residue(m) == structural
    rope_mod._PROOFS.clear()


def test_the_proof_leaves_the_global_random_state_alone():
    m = _rotate_half_match("inverse")
    rope_mod._PROOFS.clear()
    state = torch.random.get_rng_state()
    assert rope_residue(m) is not None
    assert torch.equal(torch.random.get_rng_state(), state)


def test_symbolic_sizes_are_evaluated_at_their_hints():
    """A dynamic-shape graph (symbolic S and batch): the region runs at the sizes' hints."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for name in ("hf", "inverse", "neg_around_sub"):
        torch._dynamo.reset()
        graphs.clear()
        fn = ROTATE_HALF[name]
        x, ang = torch.randn(2, 2, 7, D), torch.randn(7, H)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(x, 2)
        torch._dynamo.mark_dynamic(ang, 0)
        torch.compile(lambda x, ang: fn(x, *_paired(ang)), backend=backend, fullgraph=True)(x, ang)
        (gm,) = graphs
        key = next(n for n in gm.graph.nodes if n.op == "placeholder"
                   and isinstance(n.meta["example_value"], torch.Tensor) and n.meta["example_value"].dim() == 4)
        assert all(isinstance(key.meta["example_value"].shape[i], torch.SymInt) for i in (0, 2))
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
        m = match_rope(strip_views(out))
        proof = rope_mod._rope_proof(m)
        assert proof is not None
        assert (proof <= rope_mod._EVAL_TOL) is (name != "inverse")
        assert (rope_residue(m) is None) is (name != "inverse")


def test_every_layer_shares_one_proof(monkeypatch):
    """The layers of a model have the same region program: one evaluation per graph (memoised)."""
    (gm,), _ = capture_prefill_decode_graphs(
        build_hf_moe("mixtral", num_layers=3, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
                     top_k=2, ffn=32), torch.tensor([[1, 2, 3, 4, 5]]), max_cache_len=16)
    rope_mod._PROOFS.clear()
    calls = []
    run = rope_mod._run_program

    def counting(program):
        calls.append(program)
        return run(program)

    monkeypatch.setattr(rope_mod, "_run_program", counting)
    sites, unsupported = find_attention_sites(gm.graph)
    assert len(sites) == 3 and unsupported == [] and len(calls) == 1


@given(form=st.sampled_from(["rotate_half", "interleaved", "complex"]), pairs=st.integers(1, 8),
       extra=st.integers(0, 3), seq=st.integers(1, 6), wrong=st.booleans())
def test_partial_rotary_forms(form, pairs, extra, seq, wrong):
    """RoPE on the first ``rd = 2 * pairs`` of ``rd + 2 * extra`` channels, the rest passing through: exact forms are
    accepted, and the same forms with the sign of the sine term (or of the complex product) flipped are refused."""
    rd, d = 2 * pairs, 2 * (pairs + extra)
    x = torch.randn(1, 2, seq, d)
    ang = torch.rand(seq, pairs) * 6 - 3
    sign = -1.0 if wrong else 1.0

    def fn(x, ang):
        rot, rest = x[..., :rd], x[..., rd:]
        if form == "complex":
            xc = torch.view_as_complex(rot.reshape(*rot.shape[:-1], pairs, 2))
            y = xc * torch.polar(torch.ones_like(ang), ang)
            out = torch.view_as_real(-y if wrong else y).flatten(-2)
        elif form == "rotate_half":
            emb = torch.cat((ang, ang), -1)
            turned = torch.cat((-rot[..., pairs:], rot[..., :pairs]), -1)
            out = rot * emb.cos() + sign * (turned * emb.sin())
        else:
            emb = ang.repeat_interleave(2, -1)
            out = rot * emb.cos() + sign * (_inter(rot) * emb.sin())
        return torch.cat((out, rest), -1) if extra else out

    m = _match(fn, x, ang)
    assert m.form == form and m.rotary_dim == rd and m.partial is bool(extra)
    residue = rope_residue(m)
    assert (residue is None) is not wrong, residue


def _hf_then(change):
    """HF's rotate-half RoPE of ``x`` with paired tables, then ``change(x, y, cos, sin)`` (in place), returning y."""

    def fn(x, ang):
        c, s = _paired(ang)
        y = _hf(x, c, s)
        change(x, y, c, s)
        return y

    return fn


IN_PLACE = {
    # the rotated key written in place after RoPE: the cache gets the change, a latent rebuild would not
    "mul_": lambda x, y, c, s: y.mul_(0.5),
    "setitem": lambda x, y, c, s: y.__setitem__((..., 0), 0.0),
    "clamp_": lambda x, y, c, s: y.clamp_(-0.5, 0.5),
    "through_a_view": lambda x, y, c, s: y.view(-1)[:3].zero_(),
    "through_a_cast": lambda x, y, c, s: y.float().mul_(0.5),  # float() of a float tensor is the tensor itself
    # the pre-RoPE key or a table written after RoPE read it: the latent (or the recorded tables) would hold the
    # new values, the cached key was rotated from the old ones
    "x_after_read": lambda x, y, c, s: x.mul_(2.0),
    "table_after_read": lambda x, y, c, s: s.mul_(2.0),
}


@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_a_key_written_in_place_after_rope_is_refused(name):
    """An in-place write the region's dataflow does not show (the structural check looked only at producers, and the
    evaluation gave up on in-place writes, so the structural 'exact' stood): refused, naming the write."""
    m = _match(_hf_then(IN_PLACE[name]), X.clone(), ANG)
    residue = rope_residue(m)
    assert residue is not None and "in place" in residue, residue


def test_a_term_written_in_place_before_the_combining_add_is_refused():
    def fn(x, ang):
        c, s = _paired(ang)
        a = x * c
        a.add_(1.0)
        return a + _rh(x) * s

    residue = rope_residue(_match(fn, X.clone(), ANG))
    assert residue is not None and "in place" in residue, residue


def test_the_pre_rope_key_written_in_place_before_rope_reads_it_is_fine():
    """A write before RoPE reads the key (a pre-RoPE scale done in place) is seen by RoPE and by the latent alike."""

    def fn(x, ang):
        x.mul_(2.0)
        return _hf(x, *_paired(ang))

    assert rope_residue(_match(fn, X.clone(), ANG)) is None


@pytest.mark.parametrize("select", ["one_head_expanded", "positions_dropped"])
def test_a_key_not_shaped_like_the_pre_rope_key_is_refused(select):
    """A rotated key reduced to part of its heads or positions (then broadcast back, or not) is not the rotation of
    the pre-RoPE key: it was accepted (the evaluation gave up on the shape, the structure saw a plain getitem)."""

    def fn(x, ang):
        y = _hf(x, *_paired(ang))
        return y[:, :1].expand(-1, 2, -1, -1) if select == "one_head_expanded" else y[:, :, :3]

    m = _match(fn, X, ANG)
    residue = rope_residue(m)
    assert residue is not None and m.out.name in residue, residue


def _cached(fn, *args):
    """(RopeMatch of ``strip_views(cached)``, cached) for the tensor ``fn`` returns, as the analysis sees a cache
    write's value: RoPE then views and casts."""
    (gm,) = capture_dynamo_graphs(fn, *args)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    cached = out[0] if isinstance(out, (tuple, list)) else out
    m = match_rope(strip_views(cached))
    assert m is not None and rope_residue(m) is None
    return m, cached


XS = torch.randn(1, 2, 2, D, generator=torch.Generator().manual_seed(4))  # (B, S, Hkv, D) with S == Hkv == 2
ANG2 = ANG[:2]


def _rope_bshd(x, ang):
    """gpt-fast's rotate-half RoPE on (B, S, Hkv, D), tables (S, D)."""
    c, s = _paired(ang)
    return _hf(x, c[:, None], s[:, None])


@pytest.mark.parametrize("name, perm", [
    ("hf", (0, 1, 2, 3)),  # RoPE on (B, Hkv, S, D), written as is
    ("gpt_fast", (0, 2, 1, 3)),  # RoPE on (B, S, Hkv, D), .type_as(x).transpose(1, 2): S == Hkv, sizes cannot tell
    ("gpt_fast_complex", (0, 2, 1, 3)),  # the pairs (B, S, Hkv, D/2, 2) flattened, then transposed
])
def test_the_cached_keys_layout_is_read_off_values(name, perm):
    if name == "hf":
        m, cached = _cached(lambda x, ang: _hf(x, *_paired(ang)).contiguous(), X, ANG)
    elif name == "gpt_fast":
        m, cached = _cached(lambda x, ang: _rope_bshd(x.float(), ang).type_as(x).transpose(1, 2), XS, ANG2)
    else:
        m, cached = _cached(lambda x, ang: _complex(x, ang[:, None]).flatten(3).transpose(1, 2), XS, ANG2)
    assert rope_mod.cached_key_layout(m, cached) == (perm, None)


CHAINS = {
    # channels reordered through views (rotate-half halves interleaved): every op is a view, stripped before RoPE
    # was matched, and the proof of the region above them passed
    "channels_permuted": lambda y: y.view(1, 2, 5, 2, H).transpose(-1, -2).reshape(1, 2, 5, D),
    "heads_and_positions_scrambled": lambda y: y.reshape(1, 5, 2, D),
    "integer_cast": lambda y: y.to(torch.int32).to(torch.float32),
    "written_in_place_after_a_clone": lambda y: y.clone(),  # (then z.mul_(0.5) below)
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_a_key_changed_between_rope_and_the_cache_is_refused(name):
    """The views and casts between RoPE and the cache write are outside the region rope_residue judges: they were
    not checked at all, so a latent rebuilt keys without them (silently wrong decode)."""

    def fn(x, ang):
        z = CHAINS[name](_hf(x, *_paired(ang)))
        if name == "written_in_place_after_a_clone":
            z.mul_(0.5)
        return z

    m, cached = _cached(fn, X.clone(), ANG)
    perm, reason = rope_mod.cached_key_layout(m, cached)
    assert perm is None and reason is not None, (perm, reason)


def test_an_undecided_layout_is_none_and_nothing_raises(monkeypatch):
    m, cached = _cached(lambda x, ang: _hf(x, *_paired(ang)).transpose(1, 2), X, ANG)
    monkeypatch.setattr(rope_mod, "_EVAL_MAX_ELEMENTS", X.numel() - 1)
    rope_mod._LAYOUTS.clear()
    assert rope_mod.cached_key_layout(m, cached) == (None, None)
    assert rope_mod.cached_key_layout(m, m.x_in) == (None, None)  # not reached from m.out through views
    rope_mod._LAYOUTS.clear()


def test_table_keys_tell_the_same_computation_from_another():
    """Two layers each deriving their tables from one shared cos / sin (GLM's per-layer repeat_interleave of half the
    table) have equal keys; tables at doubled angles (a per-layer theta) do not."""

    def fn(x, ang):
        c, s = _paired(ang)
        outs = []
        for layer in range(3):
            cl = c[..., :H].repeat_interleave(2, -1) if layer < 2 else c * c - s * s
            sl = s[..., :H].repeat_interleave(2, -1) if layer < 2 else 2 * s * c
            outs.append(x * cl + _inter(x) * sl)
        return tuple(outs)

    (gm,) = capture_dynamo_graphs(fn, X, ANG)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    ms = [match_rope(strip_views(o)) for o in out]
    assert all(m is not None and rope_residue(m) is None for m in ms)
    keys = [(rope_mod.table_key(m.cos), rope_mod.table_key(m.sin)) for m in ms]
    assert ms[0].cos is not ms[1].cos and keys[0] == keys[1]
    assert keys[2] != keys[0]
    assert rope_mod.table_key(None) is None
