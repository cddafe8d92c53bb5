"""Every pair under a random stack of 1 to 3 JAX transforms: the jaxify'd
PyTorch version matches the pure-JAX version of the same math.

A failure prints the drawn ``Case`` (pair, dtype, shapes, transform stack,
vmap method, argument values); rerun one pair with
``pytest tests/property/test_transforms.py -k <pair>``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given

from conftest import assert_tree_allclose

from pairs import PAIRS, Pair, torch_version
from strategies import Case, cases, derivative_order, note_reproduction, transformed


def tolerance(dtype: str, order: int) -> float:
    """rtol = atol for comparing two implementations of the same math.

    PyTorch and XLA round differently (summation order, transcendental
    kernels); every derivative order multiplies the values by up to a few
    units and compounds the rounding, hence the growth with order.
    """
    base = 2e-5 if dtype == "float32" else 1e-10
    return base * 4**order


def run_both(case: Case):
    """Both versions under the stack, each inside one outer ``jax.jit``: one
    XLA compilation per side instead of one per primitive in eager mode
    (``Jit`` in the stack still tests jit nested under other transforms)."""
    with jax.enable_x64(case.dtype == "float64"):
        args = tuple(jnp.asarray(a) for a in case.args)
        ours = jax.jit(transformed(torch_version(case.pair, case.vmap_method), case.stack))(*args)
        reference = jax.jit(transformed(case.pair.jax_fn, case.stack))(*args)
        return ours, reference


# Pairs with a known, open engine problem: name -> reason (none at present).
_OPEN: dict[str, str] = {}


def _param(pair: Pair):
    marks = [pytest.mark.xfail(reason=_OPEN[pair.name], strict=False)] if pair.name in _OPEN else []
    return pytest.param(pair, id=pair.name, marks=marks)


@pytest.mark.parametrize("pair", [_param(p) for p in PAIRS])
def test_matches_jax_under_transform_stack(pair: Pair):
    @given(case=cases(pair))
    def check(case: Case) -> None:
        note_reproduction()
        ours, reference = run_both(case)
        tol = tolerance(case.dtype, derivative_order(case.stack))
        assert_tree_allclose(ours, reference, rtol=tol, atol=tol)

    check()


def _check_vmap_of_jacfwd_of_det(vmap_method: str) -> None:
    pair = next(p for p in PAIRS if p.name == "det")
    x = jnp.stack([jnp.zeros((3, 3)), 0.1 * jnp.eye(3), jnp.full((3, 3), 0.2)])
    ours = jax.jit(jax.vmap(jax.jacfwd(torch_version(pair, vmap_method))))(x)
    reference = jax.jit(jax.vmap(jax.jacfwd(pair.jax_fn)))(x)
    tol = tolerance("float32", 1)
    assert_tree_allclose(ours, reference, rtol=tol, atol=tol)


@pytest.mark.parametrize("vmap_method", ["sequential", "broadcast_all"])
def test_vmap_of_jacfwd_of_det_matches_jax_when_the_primal_is_batched_too(vmap_method: str):
    # What Pair.batchable_jvp=False makes the property suite draw for det.
    _check_vmap_of_jacfwd_of_det(vmap_method)


@pytest.mark.xfail(
    strict=True,
    reason="torch 2.11-2.14: torch.func.vmap over a vmap of jvp(torch.linalg.det) whose primal only the outer "
    "level batches (vmap(jacfwd(det))) is wrong past the first batch element (torch.func itself)",
)
@pytest.mark.parametrize("vmap_method", ["auto", "expand_dims"])
def test_vmap_of_jacfwd_of_det_through_torch_vmap_pytorch_gap(vmap_method: str):
    _check_vmap_of_jacfwd_of_det(vmap_method)
