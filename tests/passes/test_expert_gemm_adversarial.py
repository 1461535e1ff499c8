"""Adversarial tests of the expert GEMM rewrite (ckvp_compile/passes/expert_gemm.py) and of expert offload: each
model below was once compiled into wrong outputs.

* Grouped (sorted) dispatch: the tokens gathered with one permutation and the expert outputs un-sorted with another
  (a descending argsort, a flipped inverse), or the routing weights gathered with another one: left as written with
  the reason; the same dispatch with matching permutations (HF's ``inv[perm] = arange``, or ``argsort(perm)``) is
  rewritten.
* Views on the experts' data path: a split-transpose-merge of the features between the router's input and the expert
  GEMMs (either side) or between the down GEMM and the combine is a feature permutation and is refused; views that
  keep each token's feature row (unsqueeze, flatten of a size-1 dim) are no-ops and the layer is rewritten.
* (Token, slot) grid forms (einsums, matmuls with the weights gathered by the (T, A) ids): with T == A an equation
  that transposes the routing weights, sums over the tokens, reads a token by its slot index, or a sum over dim 0
  has the plain form's shapes; each dim's role (token, slot, feature) is followed and those are refused.
* Eager loops over range(E): each expert's tokens, routing weights ``w[token, slot]`` and accumulation must use the
  coordinates of one ``where`` of that expert's mask (token coordinate first), and every expert is visited once.
* Expert offload: ``model.load_state_dict(sd)`` after compiling updates the offloader's expert weights (host store
  and resident slots), so the compiled model computes what the plain model with ``sd`` computes; ``state_dict()``
  has the experts under their original keys (a saved offloaded model kept none), in-place edits of them reach the
  resident slots, and strict loading reports missing expert keys.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)

import ckvp_compile
from ckvp_compile import CKVPBackend, CKVPConfig, CompileRecorder, UnsupportedPatternWarning
from ckvp_compile.testing.models import build_hf_moe

OP_CALL = re.compile(r"torch\.ops\.ckvp\.moe_experts\.default\(")


def compile_and_compare(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[int], list[str]]:
    """Compile ``model`` with the expert rewrite on, check its output equals eager, and return (ckvp::moe_experts
    calls per graph, the UnsupportedPatternWarning messages)."""
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager", enable_expert_gemm=True), recorder=rec)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    messages = [str(w.message) for w in caught if issubclass(w.category, UnsupportedPatternWarning)]
    return [len(OP_CALL.findall(g.dynamo_after)) for g in rec.graphs], messages


def check_rewritten_or_refused(model: torch.nn.Module, x: torch.Tensor, reason: str | None) -> None:
    calls, messages = compile_and_compare(model, x)
    if reason is None:
        assert calls == [1] and not messages, (calls, messages)
    else:
        assert calls == [0] and any(reason in m for m in messages), messages


# ---------------------------------------------------------------------------------------------------- 1. permutations
class _SortedMoE(torch.nn.Module):
    """HF's grouped_mm experts (transformers 5, fp32: the grouped_mm_fallback op): the (token, slot) pairs sorted by
    expert id, tokens gathered as ``x[perm // A]``, weights as ``w[perm]``, grouped GEMMs over the expert offsets, the
    weighted outputs un-sorted and summed over the slots. ``variant`` changes which permutation each step uses."""

    def __init__(self, variant: str, dim: int = 16, num_experts: int = 4, ffn: int = 8, top_k: int = 2) -> None:
        super().__init__()
        self.variant, self.top_k = variant, top_k
        self.gate = torch.nn.Linear(dim, num_experts, bias=False)
        self.gate_up = torch.nn.Parameter(torch.randn(num_experts, 2 * ffn, dim) * 0.3)
        self.down = torch.nn.Parameter(torch.randn(num_experts, dim, ffn) * 0.3)

    def forward(self, x):
        v, a, e = self.variant, self.top_k, self.gate_up.shape[0]
        w, idx = torch.topk(F.softmax(self.gate(x), -1), a, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        ids, sw = idx.reshape(-1), w.reshape(-1)
        ids_g, perm = torch.sort(ids)
        other = torch.argsort(ids, descending=True)
        xs = x[(other if v == "gather_other" else perm) // a]
        ws = sw[other if v == "weights_other" else perm]
        offs = torch.cumsum(torch.histc(ids_g.float(), bins=e, min=0, max=e - 1), dim=0, dtype=torch.int32)
        g, u = torch.ops.transformers.grouped_mm_fallback(xs, self.gate_up.transpose(-2, -1), offs=offs).chunk(2, -1)
        y = torch.ops.transformers.grouped_mm_fallback(F.silu(g) * u, self.down.transpose(-2, -1), offs=offs)
        y = y * ws.unsqueeze(-1)
        if v == "argsort_inverse":
            inv = torch.argsort(perm)
        else:
            p = other if v == "unsort_other" else perm
            inv = torch.empty_like(p)
            inv[p] = torch.arange(p.size(0))
            inv = inv.flip(0) if v == "unsort_flipped" else inv
        return y[inv].view(x.shape[0], a, x.shape[1]).sum(dim=1)


@pytest.mark.parametrize("variant, reason", [
    ("plain", None),
    ("argsort_inverse", None),
    ("gather_other", "neither P // A"),
    ("weights_other", "ws gathers the (token, slot) rows with other"),
    ("unsort_other", "neither the sort permutation of the expert ids nor its inverse"),
    ("unsort_flipped", "neither the sort permutation of the expert ids nor its inverse"),
])
def test_grouped_dispatch_gather_and_unsort_use_one_permutation(variant, reason):
    """The op pairs row (t, a) with token t, expert ids[t, a] and weight w[t, a]; a grouped dispatch is rewritten
    only when its token gather, weight gather and un-sort are P // A, P and P^-1 for one sort P of the expert ids
    (each refused variant was once rewritten: outputs off by ~2-4)."""
    torch.manual_seed(0)
    check_rewritten_or_refused(_SortedMoE(variant).eval(), torch.randn(7, 16), reason)


# ---------------------------------------------------------------------------------------------------- 2. views
class _ViewMoE(torch.nn.Module):
    """A gpt-fast-style einsum MoE layer with views on the experts' data path, by ``variant``."""

    def __init__(self, variant: str, dim: int = 16, num_experts: int = 4, ffn: int = 8) -> None:
        super().__init__()
        self.variant = variant
        self.gate = torch.nn.Linear(dim, num_experts, bias=False)
        self.w1, self.w3 = (torch.nn.Parameter(torch.randn(num_experts, ffn, dim) * 0.3) for _ in range(2))
        self.w2 = torch.nn.Parameter(torch.randn(num_experts, dim, ffn) * 0.3)

    @staticmethod
    def _swap_halves(x):  # (..., D) -> (..., D) with the two halves of the features interleaved
        return x.view(*x.shape[:-1], 2, x.shape[-1] // 2).transpose(-2, -1).reshape(x.shape)

    def forward(self, x):
        v, t = self.variant, x.shape[0]
        xr = self._swap_halves(x) if v == "router_permuted" else x
        w, idx = torch.topk(F.softmax(self.gate(xr), dim=-1), 2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        xe = {"experts_permuted": self._swap_halves(x), "row_views": x.unsqueeze(1).flatten(1).view(t, 1, -1)[:, 0],
              }.get(v, x)
        h = F.silu(torch.einsum("ti,taoi->tao", xe, self.w1[idx])) * torch.einsum("ti,taoi->tao", xe, self.w3[idx])
        out = torch.einsum("tao,taio->tai", h, self.w2[idx])
        out = self._swap_halves(out) if v == "output_permuted" else out
        return torch.einsum("tai,ta->ti", out, w)


@pytest.mark.parametrize("variant, reason", [
    ("plain", None),
    ("row_views", None),
    ("experts_permuted", "not the router's input"),
    ("router_permuted", "not the router's input"),
    ("output_permuted", "between the down GEMM"),
])
def test_views_that_split_feature_rows_are_not_no_ops(variant, reason):
    """``x.view(T, 2, Dm // 2).transpose(1, 2).reshape(T, Dm)`` permutes the features: the experts must read the
    router's input row for row (it was taken for a view of it and the op was given the other tensor); views that
    keep every feature row (unsqueeze / flatten / a size-1 index) are no-ops and the layer is rewritten."""
    torch.manual_seed(0)
    check_rewritten_or_refused(_ViewMoE(variant).eval(), torch.randn(7, 16), reason)


# ---------------------------------------------------------------------------------------------------- 3. offload
def _mixtral():
    return build_hf_moe("mixtral", num_layers=2, num_experts=4, top_k=2, use_cache=False)


@torch.no_grad()
def test_load_state_dict_after_compiling_an_offloaded_model_updates_its_experts():
    """The offloader holds its own copies of the experts (host store, device slots): ``load_state_dict`` on the
    offloaded model used to leave them as they were (unexpected keys, ignored with strict=False), so the compiled
    model mixed the new router with the old experts. Now the experts follow, strict or not, with no recompile."""
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    model = _mixtral()
    compiled = ckvp_compile.compile(model, expert_offload=2, options={"compiler": "aot_eager"})
    before = compiled(ids).logits
    plain = _mixtral()
    torch.testing.assert_close(before, plain(ids).logits, rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(1)
    for strict in (False, True):
        sd = {k: v + 0.2 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
              for k, v in plain.state_dict().items()}
        plain.load_state_dict(sd)
        assert any(k.endswith("experts.gate_up_proj") for k in sd)
        model.load_state_dict(sd, strict=strict)
        torch.testing.assert_close(compiled(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(compiled(ids).logits, before, atol=1e-3)
    bad = {k: v[:, :-1] for k, v in sd.items() if k.endswith("layers.0.mlp.experts.down_proj")}
    with pytest.raises(RuntimeError, match=r"layers\.0\.mlp\.experts\.down_proj.*expert weight must be"):
        model.load_state_dict(bad, strict=False)
    ckvp_compile.offloader_of(model).close()


@torch.no_grad()
@pytest.mark.parametrize("how", ["offload_experts", "compile"])
def test_state_dict_of_an_offloaded_model_keeps_its_experts(how, tmp_path):
    """``model.state_dict()`` of an offloaded model used to have no expert weights (the experts module was replaced
    by a parameterless OffloadedExperts), so saving it and loading the file into a fresh model lost them (strict
    loading failed, ``strict=False`` kept the fresh model's experts). Now the experts are under their original keys,
    with the un-offloaded model's shapes, dtypes and values, on CPU; torch.save and safetensors round trips give
    the saved model's logits."""
    from safetensors.torch import load_file, save_file

    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    plain = _mixtral()
    expected = {k: v.clone() for k, v in plain.state_dict().items()}
    model = _mixtral()
    if how == "compile":
        run = ckvp_compile.compile(model, expert_offload=2, options={"compiler": "aot_eager"})
    else:
        ckvp_compile.offload_experts(model, resident=2)
        run = model
    run(ids)  # the cache has moved experts around: the state dict still lists them in expert order
    sd = model.state_dict()
    assert sorted(sd) == sorted(expected)
    assert sum(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in sd) == 4
    for k, v in expected.items():
        assert sd[k].shape == v.shape and sd[k].dtype == v.dtype and sd[k].device.type == "cpu", k
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0, msg=k)
    torch.save(sd, tmp_path / "model.pt")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    want = plain(ids).logits
    for loaded in (torch.load(tmp_path / "model.pt"), load_file(str(tmp_path / "model.safetensors"))):
        fresh = build_hf_moe("mixtral", num_layers=2, num_experts=4, top_k=2, use_cache=False, seed=7)
        ckvp_compile.offload_experts(fresh, resident=2)
        assert not torch.allclose(fresh(ids).logits, want, atol=1e-3)
        fresh.load_state_dict(loaded)  # strict: every key, the experts included
        torch.testing.assert_close(fresh(ids).logits, want, rtol=1e-5, atol=1e-5)
        unoffloaded = build_hf_moe("mixtral", num_layers=2, num_experts=4, top_k=2, use_cache=False, seed=7)
        unoffloaded.load_state_dict(loaded)  # and a plain model takes the offloaded model's state dict
        torch.testing.assert_close(unoffloaded(ids).logits, want, rtol=1e-5, atol=1e-5)
        ckvp_compile.offloader_of(fresh).close()
    ckvp_compile.offloader_of(model).close()


@torch.no_grad()
def test_offloaded_state_dict_edits_missing_keys_and_closed_offloader():
    """The state dict's expert tensors share the offloader's host store (as a plain model's share its parameters):
    an in-place edit reaches the resident slots too (before, only experts copied in later saw it: a silent mix of
    old and new experts). Strict loading of a state dict without the experts reports them missing (it used to keep
    the old experts silently); a closed offloader's model refuses state_dict() instead of returning one without
    its experts."""
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    plain, model = _mixtral(), _mixtral()
    compiled = ckvp_compile.compile(model, expert_offload=2, options={"compiler": "aot_eager"})
    compiled(ids)
    for sd in (model.state_dict(), plain.state_dict()):
        for k in sd:
            if k.endswith("experts.down_proj"):
                sd[k].mul_(-1.5)  # every expert, the resident ones included
    torch.testing.assert_close(compiled(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    partial = {k: v for k, v in plain.state_dict().items() if not k.endswith("layers.1.mlp.experts.gate_up_proj")}
    with pytest.raises(RuntimeError, match=r"Missing key.*layers\.1\.mlp\.experts\.gate_up_proj"):
        model.load_state_dict(partial)
    model.load_state_dict(partial, strict=False)
    ckvp_compile.offloader_of(model).close()
    with pytest.raises(ckvp_compile.CKVPConfigError, match="was closed.*load the model again"):
        model.state_dict()


# ---------------------------------------------------------------------------------------------------- 4. grid dims
class _GridMoE(torch.nn.Module):
    """(token, slot) grid forms: gpt-fast einsums, or matmuls with the weights gathered by the (T, A) ids
    (``W[ids] @ x[:, None, :, None]``), the combine an einsum or ``(y * w[..., None]).sum(1)``. ``variant``
    changes which dims an equation, a broadcast or the sum pairs; with T == A every variant has the plain
    form's shapes, so only the dims' roles tell them apart."""

    def __init__(self, variant: str, dim: int = 16, num_experts: int = 4, ffn: int = 8) -> None:
        super().__init__()
        self.variant = variant
        self.gate = torch.nn.Linear(dim, num_experts, bias=False)
        self.w1, self.w3 = (torch.nn.Parameter(torch.randn(num_experts, ffn, dim) * 0.3) for _ in range(2))
        self.w2 = torch.nn.Parameter(torch.randn(num_experts, dim, ffn) * 0.3)

    def forward(self, x):
        v = self.variant
        w, idx = torch.topk(F.softmax(self.gate(x), dim=-1), 2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        if v.startswith("mm"):
            xc = x[None, :, :, None] if v == "mm_x_by_slot" else x[:, None, :, None]  # (T, 1, Dm, 1)
            h = F.silu(torch.matmul(self.w1[idx], xc)) * torch.matmul(self.w3[idx], xc)  # (T, A, I, 1)
            y = torch.matmul(self.w2[idx], h).squeeze(-1)  # (T, A, Dm)
            ws = w.t() if v == "mm_weights_transposed" else w
            return (y * ws[..., None]).sum(0 if v == "mm_sums_tokens" else 1)
        up_eq = "ai,taoi->tao" if v == "einsum_x_by_slot" else "ti,taoi->tao"
        h = F.silu(torch.einsum(up_eq, x, self.w1[idx])) * torch.einsum(up_eq, x, self.w3[idx])
        out = torch.einsum("ato,taio->tai" if v == "einsum_down_swapped" else "tao,taio->tai", h, self.w2[idx])
        eq = {"einsum_weights_transposed": "tai,at->ti", "einsum_sums_tokens": "tai,ta->ai",
              "einsum_outer_slots": "tai,tb->ti"}.get(v, "tai,ta->it" if v.startswith("einsum_output") else "tai,ta->ti")
        y = torch.einsum(eq, out, w)  # (Dm, T) for the einsum_output variants
        return {"einsum_output_transposed": y.t(), "einsum_output_reshaped": y.reshape(x.shape)}.get(v, y)


@pytest.mark.parametrize("variant, reason", [
    ("einsum", None),
    ("mm", None),
    ("mm_weights_transposed", None),  # the op reads w.t(), the tensor the model multiplies by: still exact
    ("einsum_weights_transposed", "token"),
    ("einsum_sums_tokens", "token"),
    ("einsum_outer_slots", "slot"),
    ("einsum_output_transposed", "token"),  # == the plain form, but was rewritten into (the op's output).view(Dm, T).t()
    ("einsum_output_reshaped", "token"),
    ("einsum_x_by_slot", "token"),
    ("einsum_down_swapped", "token"),
    ("mm_sums_tokens", "token"),
    ("mm_x_by_slot", "token"),
])
def test_grid_forms_pair_tokens_and_slots_by_their_dims(variant, reason):
    """In the (token, slot) grid forms only the dims of each einsum / matmul / sum say which is the token and which
    the slot: with T == A (2 tokens, top-2) an equation that transposes the routing weights, sums over the tokens,
    reads the token by the slot index, or a sum over dim 0 has the plain form's shapes. Each refused variant was
    once rewritten into wrong outputs (the plain form's, or for a (Dm, T) routed output, the op's (T, Dm) output
    viewed as (Dm, T))."""
    torch.manual_seed(0)
    model = _GridMoE(variant).eval()
    x = torch.randn(2, 16)
    with torch.no_grad():  # the variants compute something else than the plain form: the test can tell them apart
        if reason is not None and variant != "einsum_output_transposed":
            plain = _GridMoE("einsum").eval()
            plain.load_state_dict(model.state_dict())
            assert not torch.allclose(model(x), plain(x), atol=1e-3)
    check_rewritten_or_refused(model, x, reason)

# ---------------------------------------------------------------------------------------------------- 5. eager loops
class _WhereLoopMoE(torch.nn.Module):
    """An eager loop over range(E): ``token, slot = torch.where(ids == e)`` (or of a one-hot mask), the expert's
    tokens ``x[token]``, its routing weights ``w[token, slot]``, summed with ``index_add_`` at ``token``. ``variant``
    changes which indices the weights are gathered with, which mask picks the tokens, or which experts the loop
    visits, or adds a router output no weights stack. T == A (4 tokens, top-4 of 6 experts), so ``w[slot, token]``
    has the plain form's shape."""

    def __init__(self, variant: str, dim: int = 16, num_experts: int = 6, ffn: int = 8) -> None:
        super().__init__()
        self.variant = variant
        # "null_expert": the router scores one more expert than the weights stack (a zero-computation expert)
        self.gate = torch.nn.Linear(dim, num_experts + (variant == "null_expert"), bias=False)
        self.gate_up = torch.nn.Parameter(torch.randn(num_experts, 2 * ffn, dim) * 0.3)
        self.down = torch.nn.Parameter(torch.randn(num_experts, dim, ffn) * 0.3)

    def forward(self, x):
        v, e_count = self.variant, self.gate_up.shape[0]
        w, ids = torch.topk(F.softmax(self.gate(x), -1), x.shape[0], dim=-1)
        w = w / w.sum(-1, keepdim=True)
        acc = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.gate.out_features).permute(2, 1, 0)  # (E, A, T)
        for e in range(e_count - 1 if v == "skips_an_expert" else e_count):
            if v == "one_hot":
                slot, token = torch.where(mask[e])
            elif v == "one_hot_coords_swapped":
                token, slot = torch.where(mask[e])  # the coords of mask[e] (A, T) are (slot, token)
            elif v == "ids_transposed":
                slot, token = torch.where(ids.t() == e)
            elif v == "ids_transposed_coords_swapped":
                token, slot = torch.where(ids.t() == e)
            elif v == "other_expert":
                token, slot = torch.where(ids == (e + 1) % e_count)
            else:
                token, slot = torch.where(ids == e)
            wt = {"slot_flipped": lambda: w[token, slot.flip(0), None], "swapped": lambda: w[slot, token, None],
                  "token_twice": lambda: w[token, token, None]}.get(v, lambda: w[token, slot, None])()
            g, u = F.linear(x[token], self.gate_up[e]).chunk(2, dim=-1)
            acc.index_add_(0, token, F.linear(F.silu(g) * u, self.down[e]) * wt)
        return acc


@pytest.mark.parametrize("variant, reason", [
    ("where_ids", None),
    ("one_hot", None),
    ("ids_transposed", None),
    ("slot_flipped", "slot"),
    ("swapped", "token"),
    ("token_twice", "token"),
    ("one_hot_coords_swapped", "token"),
    ("ids_transposed_coords_swapped", "token"),
    ("other_expert", "expert"),
    ("skips_an_expert", "expert"),
    ("null_expert", "the router scores E = 7 experts but down weight"),
])
def test_eager_loop_weights_gathered_with_the_where_that_picked_the_tokens(variant, reason):
    """An eager loop's expert e must read the tokens ``where`` found for expert e, weight each with ``w[token,
    slot]`` at the coordinates of that same ``where`` (the token coordinate first), and every expert must be
    visited once: otherwise it is left as written (each refused variant was once rewritten, with wrong outputs)."""
    torch.manual_seed(0)
    model = _WhereLoopMoE(variant).eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        if variant != "null_expert":  # (its router has one more output)
            plain = _WhereLoopMoE("where_ids").eval()
            plain.load_state_dict(model.state_dict())
            assert torch.allclose(model(x), plain(x), atol=1e-5) == (reason is None)  # the variants differ
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        check_rewritten_or_refused(model, x, reason)
