"""Derivatives of a PyTorch function that draws random numbers replay the
draws of its value (NOTE [derivatives replay the value's draws]): after
``torch.manual_seed(s)``, every transform of a jaxify'd function with
dropout equals the same transform of pure JAX with the mask seed ``s``
draws, and leaves PyTorch's generator where one plain call leaves it. In
whatever compile mode ``T2J_AD_COMPILE`` sets (the graph-mode run of
scripts/run_tests.sh includes this file: NOTE [the generator around a graph]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from conftest import TORCH_DEVICE, assert_tree_allclose, to_numpy
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import note_reproduction

import t2j_ad

TRANSFORMS = {
    "value_and_grad": lambda f: jax.value_and_grad(lambda x: jnp.sum(f(x) ** 2)),
    "jvp": lambda f: lambda x: jax.jvp(f, (x,), (jnp.cos(x),)),
    "vjp": lambda f: lambda x: jax.vjp(f, x)[1](jnp.sin(x)),
    "jacrev": jax.jacrev,
    "jacfwd": jax.jacfwd,
    "hessian": lambda f: jax.hessian(lambda x: jnp.sum(f(x) ** 3)),
}


@settings(max_examples=settings.default.max_examples)
@given(
    shape=st.sampled_from([(3,), (2, 3), (4, 1)]),
    p=st.floats(0.1, 0.9),
    transform=st.sampled_from(sorted(TRANSFORMS)),
    method=st.sampled_from(["auto", "expand_dims", "broadcast_all"]),
    use_jit=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_every_transform_replays_the_values_mask(shape, p, transform, method, use_jit, seed) -> None:
    note_reproduction()

    def dropped(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(torch.nn.functional.dropout(x, p, training=True)) * x

    with jax.enable_x64(True):
        x = jnp.asarray(np.linspace(-1.5, 2.0, int(np.prod(shape))).reshape(shape), dtype=jnp.float64)
        torch.manual_seed(seed)
        mask = to_numpy(torch.nn.functional.dropout(torch.ones(shape, dtype=torch.float64, device=TORCH_DEVICE), p))
        expected_after = torch.rand(3, device=TORCH_DEVICE)
        expected = TRANSFORMS[transform](lambda x: jnp.sin(x * mask) * x)(x)

        jf = t2j_ad.jaxify(dropped, vmap_method=method)
        f = TRANSFORMS[transform](jf)
        f = jax.jit(f) if use_jit else f
        jax.block_until_ready(f(x))  # traced (and in graph mode compiled) outside the seeded run
        torch.manual_seed(seed)
        got = jax.block_until_ready(f(x))
        after = torch.rand(3, device=TORCH_DEVICE)
    assert_tree_allclose(got, expected, rtol=1e-10, atol=1e-10)
    assert torch.equal(after, expected_after)
