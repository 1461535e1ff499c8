"""What the attention output sees of a value error: token-independent noise is averaged, truncation is not.

A decode step's attention output for query ``t`` of layer ``l`` is ``o_t = sum_s p_ts v_s``. The latent store
changes every cached value ``v_s`` (``s < t``; the query's own value is exact) by an error ``e_s``, so the output
changes by ``sum_{s<t} p_ts e_s``. Two kinds of error behave differently there:

* **Quantization noise.** The per-token block quantizer rounds each token's coordinates on their own, so the
  errors of different tokens are (close to) independent with zero mean. Then
  ``E || sum_s p_ts e_s ||^2 = sum_s p_ts^2 E ||e_s||^2``: the noise reaches the output scaled by
  ``kappa_t = sum_{s<t} p_ts^2``, which is ``1 / n_eff`` for an attention spread evenly over ``n_eff`` tokens
  (the inverse participation ratio, the "effective number of attended tokens"; it is 1 only when the query
  attends to one cached token). Per coordinate ``i`` of a stacked (cross-layer) latent with basis column
  ``p_i`` (layer ``l``'s part ``p_i,l``), a per-coordinate noise variance ``q_i`` costs
  ``q_i * sum_l ||p_i,l||^2 kappa_l`` at the outputs of the group's layers, ``kappa_l`` the mean of
  ``kappa_t`` over queries (:attr:`KVMoments.attn_sumsq`).
* **Truncation.** Dropping coordinate ``i`` removes ``p_i (p_i . x_s)`` from every token, a deterministic
  function of the token: whatever the tokens share (a common direction, a slowly varying component) survives the
  averaging. The output error of layer ``l`` is ``p_i,l (p_i . y_t)`` with ``y_t = sum_{s<t} p_ts x_s`` the
  attended stacked values, so its expected energy over the group's layers is
  ``c_i = sum_l ||p_i,l||^2 p_i^T E[y y^T]_l p_i`` (:attr:`KVMoments.v_attended`). Components that vary from
  token to token average out like noise (``c_i`` near ``kappa * lambda_i``); coherent ones keep ``c_i`` near
  ``lambda_i``. Cross terms between coordinates are ignored (the basis diagonalises ``E[x x^T]``, not
  ``E[y y^T]``).

:func:`value_error_scales` turns these into the planner's per-coordinate error model for values
(:func:`~ckvp_compile.latent.planner.plan_bits`, ``error_scales``):

* ``mode="noise"``: quantization error times ``sum_l ||p_i,l||^2 kappa_l``, truncation error ``lambda_i`` as
  before (the value noise discounted, truncation counted per token);
* ``mode="output"``: the output-space model above: truncation error ``c_i``, quantization error times
  ``sum_l ||p_i,l||^2 kappa_l`` (both measured at the attention output; a unit's errors are then normalised by
  ``sum_i c_i``, the energy of its attended values).

Keys are left as they are: a key error moves the attention scores, and its effect on the output is not a sum
of per-token value errors (a shift shared by every cached token cancels in the softmax).

Sources: the variance of a weighted sum of independent errors (``Var(sum_s p_s e_s) = sum_s p_s^2 Var(e)``);
``1 / sum p^2`` as the effective number of tokens an attention head averages over (the inverse participation
ratio; Kish's effective sample size of weights ``p``). The measured attention weights are the model's own on
the calibration windows.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CKVPConfigError

__all__ = ["VALUE_NOISE_MODES", "value_error_scales"]

#: Modes of :func:`value_error_scales`.
VALUE_NOISE_MODES = ("noise", "output")


def value_error_scales(moments: Any, bases: Any, mode: str = "noise") -> dict[str, list[dict[str, torch.Tensor]]]:
    """The planner's per-coordinate error model of the values, from the calibration's attention statistics.

    Args:
        moments: the :class:`~ckvp_compile.latent.KVMoments` the bases were built from, with
            :attr:`~ckvp_compile.latent.KVMoments.attn_sumsq` for every layer (and, for ``mode="output"``,
            :attr:`~ckvp_compile.latent.KVMoments.v_attended`).
        bases: full-rank :class:`~ckvp_compile.latent.LatentBases` of the same groups (``moments.bases(1.0)``):
            principal components ``p_i`` (columns, (Hkv, G_g*D, N)) and eigenvalues ``lambda_i``.
        mode: ``"noise"`` or ``"output"`` (module docstring).
    Returns:
        ``{"v": [per group {"noise": (Hkv, N) float64, "drop": (Hkv, N) float64}]}``: ``noise[h, i]`` multiplies
        coordinate i's quantization error (``sum_l ||p_i,l||^2 kappa_l``, in (0, 1]); ``drop[h, i]`` is its
        truncation error (``lambda_i`` for ``"noise"``, ``c_i`` for ``"output"``), in the units of the
        eigenvalues (squared value units per token).
    Raises:
        CKVPConfigError: an unknown mode, the attention statistics are missing (the calibration did not find
            the queries and keys of every layer; for ``"output"``, moments collected without
            ``attended_values=True``), or the moments and bases have other groups.
    """
    if mode not in VALUE_NOISE_MODES:
        raise CKVPConfigError(f"mode must be one of {list(VALUE_NOISE_MODES)}, got {mode!r}")
    groups = tuple(tuple(g) for g in bases.groups)
    if tuple(tuple(g) for g in moments.groups) != groups:
        raise CKVPConfigError(f"the moments' groups {moments.groups} are not the bases' {bases.groups}: build the "
                              "bases from these moments (moments.bases(1.0)) or regroup the moments")
    missing = [layer for layers in groups for layer in layers if layer not in moments.attn_sumsq]
    if missing:
        raise CKVPConfigError(f"no attention statistics for layers {missing}: calibration did not find their "
                              "post-RoPE queries and keys; plan without the value-noise model")
    if mode == "output" and len(moments.v_attended) != len(groups):
        raise CKVPConfigError("mode='output' needs the attended value moments of every group (KVMoments.v_attended): "
                              "collect the moments with collect_kv_moments(..., attended_values=True) (measured where "
                              "calibration finds every layer's queries and keys), or use mode='noise'")
    d, out = bases.head_dim, []
    for g, layers in enumerate(groups):
        p = bases.basis("v")[g].detach().cpu().double()  # (Hkv, G_g*D, N)
        if p.shape[1] != p.shape[2]:
            raise CKVPConfigError("value_error_scales needs full-rank bases (moments.bases(1.0))")
        hkv, n = p.shape[0], p.shape[2]
        share = p.view(hkv, len(layers), d, n).square().sum(2)  # (Hkv, G_g, N): ||p_i,l||^2, sums to 1 over l
        kappa = torch.stack([moments.attn_sumsq[layer].double().cpu() for layer in layers], 1)  # (Hkv, G_g)
        noise = (share * kappa[:, :, None]).sum(1)
        if mode == "noise":
            drop = bases.eigenvalues("v")[g].detach().cpu().double().clamp_min(0)
        else:
            m = moments.v_attended[g].double().cpu()  # (G_g, Hkv, G_g*D, G_g*D)
            proj = torch.einsum("hai,lhab,hbi->hli", p, m, p)  # (Hkv, G_g, N): p_i^T E[y y^T]_l p_i
            drop = (share * proj).sum(1).clamp_min(0)
        out.append({"noise": noise, "drop": drop})
    return {"v": out}
