"""jaxstate's only changes to JAX itself, installed on import: two narrow extensions
of its batching rules, the commitment of references, one cache more for
`jax.clear_caches()` to clear, a dispatch of compiled calls that touch
references which remembers what JAX's works out (`../_dispatch.py`), and a
discharge of the references a program creates that keeps its equations
(`../_discharge.py`).

The batching rules change only cases where JAX (0.10.x) raises; every other case
goes to JAX's own rule unchanged. They exist because jaxstate keeps state in
*unbatched* references and does its own per-member slicing (see `_vmap.py` and
docs/design.md, "vmap"). A reference is committed to a device when its buffer is
(`_jax.buffer_commitment_of_refs`), so that a compiled call touching state returns
uncommitted arrays from uncommitted inputs, as it would without state.
`jax.clear_caches()` also clears the cache through which `eqx.filter_jit` kept
every model holding an index in static data (`_jax.clear_donation_cache_with_jax`;
docs/design.md, "Lifetime").
"""

import jax.lax as lax

from .. import _discharge, _dispatch, _jax


#
# JAX refuses any write to an unbatched reference under vmap, even of an unbatched
# value. jaxstate's writes are unbatched by construction (`write_p` hands back the
# whole stacked value, unbatched), so exactly that case is let through: an unbatched
# value written to an unbatched reference means the same for every member.
#
def _swap_batcher(axis_data, vals, dims, **params):
    if all(d is None for d in dims):
        return _jax.swap_p.bind(*vals, **params), None
    return _jax_swap_batcher(axis_data, vals, dims, **params)


#
# JAX refuses `lax.cond` with any reference effect under vmap. With a predicate that
# is the same for every member the branches can be batched like any other function:
# the cond stays a cond. With a per-member predicate JAX runs every branch and
# selects: fine for branches that only read state, but every branch's writes would
# land, so writing stays refused, with a message that says what to do instead.
#
def _cond_batcher(axis_data, args, dims, *, branches, **params):
    effects = [eff for b in branches for eff in _jax.ref_effects(b.jaxpr)]
    if not effects:
        return _jax_cond_batcher(axis_data, args, dims, branches=branches, **params)
    index, *ops = args
    index_dim, *op_dims = dims
    if index_dim is not None:
        if not all(_jax.is_read_effect(eff) for eff in effects):
            raise NotImplementedError(
                "A `lax.cond`/`lax.switch` whose predicate differs between vmap "
                "members cannot write state: write `jnp.where(pred, new, old)` "
                "instead. See docs/misuse.md#cond-per-member-write."
            )
        return _select_branches(axis_data, index, index_dim, ops, op_dims, branches)
    ops_batched = [d is not None for d in op_dims]
    ops = [
        _jax.moveaxis(x, d, 0) if d is not None else x
        for x, d in zip(ops, op_dims, strict=True)
    ]
    out_batched = [
        any(bs)
        for bs in zip(
            *(_jax.batch_jaxpr(b, axis_data, ops_batched, False)[1] for b in branches),
            strict=True,
        )
    ]
    batched = tuple(
        _jax.batch_jaxpr(b, axis_data, ops_batched, out_batched)[0] for b in branches
    )
    out = _jax.cond_p.bind(index, *ops, branches=batched, **params)
    return out, [0 if b else None for b in out_batched]


def _select_branches(axis_data, index, index_dim, ops, op_dims, branches):
    # As JAX does for a per-member predicate without state, except that references
    # stay unbatched (reading them in every branch changes nothing).
    size, mesh_axis = axis_data.size, axis_data.explicit_mesh_axis
    is_ref = [_jax.is_abstract_ref(_jax.typeof(x)) for x in ops]
    index = _jax.bdim_at_front(index, index_dim, size, mesh_axis=mesh_axis)
    ops = [
        x if r else _jax.bdim_at_front(x, d, size, mesh_axis=mesh_axis)
        for x, d, r in zip(ops, op_dims, is_ref, strict=True)
    ]
    in_batched = [not r for r in is_ref]
    out_batched = [True] * len(branches[0].out_avals)
    outs = []
    for i, branch in enumerate(branches):
        batched = _jax.batch_jaxpr(branch, axis_data, in_batched, out_batched)[0]
        # Unselected branches get no gradient (JAX's guard against NaNs there).
        chosen = lax.eq(index, lax.full_like(index, i))
        ops_i = [
            x if r else _jax.bcast_select(chosen, x, lax.stop_gradient(x))
            for x, r in zip(ops, is_ref, strict=True)
        ]
        outs.append(_jax.jaxpr_as_fun(batched)(*ops_i))
    out = [_jax.bcast_select_n(index, *xs) for xs in zip(*outs, strict=True)]
    return out, [0] * len(out)


_jax_swap_batcher = _jax.batching_rule(_jax.swap_p)
_jax_cond_batcher = _jax.batching_rule(_jax.cond_p)
if not getattr(_jax_swap_batcher, "jaxstate_patch", False):
    for _prim, _rule in [(_jax.swap_p, _swap_batcher), (_jax.cond_p, _cond_batcher)]:
        _rule.jaxstate_patch = True  # pyright: ignore[reportFunctionMemberAccess]
        _jax.set_batching_rule(_prim, _rule)
_jax.buffer_commitment_of_refs()
_jax.clear_donation_cache_with_jax()
_dispatch.install()
_discharge.install()
