"""The table of paired functions: one PyTorch and one pure-JAX version of the
same math, with the shapes and value domains each is tested on.

Every function takes positional arrays and returns one array (or a tuple).
Domains keep each function smooth where it is tested: positive inputs for
``log``/``sqrt``/``cumprod``, points away from the kinks of ``where`` and
``clamp``, and linear-algebra inputs that the function itself makes well
conditioned (``a + 3 I`` for ``solve``, ``a aᵀ + n I`` for ``cholesky``), so
any value drawn, batched or perturbed by a tangent stays valid.

NOTE [small shape alphabet]
Each distinct shape, dtype and transform stack costs one JAX compilation, so
each pair lists a few fixed shape tuples (including 0-d and size-1
dimensions where the math allows) instead of drawing free shapes. The CI
profile then compiles a bounded number of programs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch

import t2j_ad


@dataclasses.dataclass(frozen=True)
class Domain:
    """Where one argument's values are drawn: ``[lo, hi]`` for floats, minus
    ``margin`` around each point of ``avoid``; ``integer=True`` draws ints in
    ``[lo, hi]`` (indices, class labels), which are never differentiated."""

    lo: float
    hi: float
    avoid: tuple[float, ...] = ()
    margin: float = 0.15
    integer: bool = False


REAL = Domain(-2.0, 2.0)
SMALL = Domain(-0.5, 0.5)
POSITIVE = Domain(0.5, 2.0)
AWAY_FROM_ZERO = Domain(-2.0, 2.0, avoid=(0.0,))


def index(n: int) -> Domain:
    return Domain(0, n - 1, integer=True)


@dataclasses.dataclass(frozen=True)
class Pair:
    """``torch_fn`` and ``jax_fn`` compute the same math on ``shapes``."""

    name: str
    torch_fn: Callable[..., object]
    jax_fn: Callable[..., object]
    domains: tuple[Domain, ...]
    # Each entry: one shape per argument.
    shapes: tuple[tuple[tuple[int, ...], ...], ...]
    # The highest derivative order PyTorch itself computes (see the table).
    max_order: int = 99
    # False where PyTorch's own forward-mode formula cannot be differentiated
    # again: no derivative is then drawn on top of jvp/jacfwd/hessian.
    differentiable_jvp: bool = True
    # False where torch.vmap over PyTorch's forward mode gives wrong values
    # when the primal is batched at an outer level only: a vmap drawn on top of
    # jvp/jacfwd/hessian then uses "broadcast_all" for "auto"/"expand_dims".
    batchable_jvp: bool = True
    # False where torch.vmap fails when two vmaps batch the arguments at
    # different levels: "expand_dims" is then not drawn for stacks that hand
    # PyTorch two vmaps or more ("auto" falls back to the loop by itself).
    vmap_across_levels: bool = True
    # False where jax.experimental.jet has no rule for a primitive the JAX
    # version uses (reduce_prod, custom_linear_solve, cholesky, cumlogsumexp,
    # a scalar select): no jet is drawn, there is no reference to hold it to.
    jax_jet: bool = True

    def __repr__(self) -> str:
        return f"Pair({self.name})"

    @property
    def float_args(self) -> tuple[int, ...]:
        """Arguments that transforms may differentiate with respect to."""
        return tuple(i for i, d in enumerate(self.domains) if not d.integer)


def _same(*shapes: tuple[int, ...], n: int = 2) -> tuple[tuple[tuple[int, ...], ...], ...]:
    return tuple((s,) * n for s in shapes)


ANY = ((), (1,), (3,), (2, 3), (1, 3))  # 0-d and size-1 dims included
VECTORS = ((1,), (3,), (2, 3), (1, 3))  # at least one dimension


# -- elementwise --------------------------------------------------------------


def _t_exp_tanh(x, y):
    return torch.exp(x / 2) * torch.tanh(y) + x * y


def _j_exp_tanh(x, y):
    return jnp.exp(x / 2) * jnp.tanh(y) + x * y


def _t_log_sqrt(x):
    return torch.log(x) * torch.sqrt(x) + torch.reciprocal(x)


def _j_log_sqrt(x):
    return jnp.log(x) * jnp.sqrt(x) + 1 / x


def _t_div_pow(x, y):
    return x / y + x**3 - torch.sin(y) ** 2


def _j_div_pow(x, y):
    return x / y + x**3 - jnp.sin(y) ** 2


def _t_broadcast(x, b):
    return torch.sigmoid(x + b) * b


def _j_broadcast(x, b):
    return jax.nn.sigmoid(x + b) * b


# -- reductions ---------------------------------------------------------------


def _t_reduce(x):
    # prod of factors that are never zero: PyTorch's prod backward special-cases
    # zeros, and its third derivative there disagrees with the math.
    return (x**2).sum(-1) + x.mean() + (x**2 + 1).prod(-1)


def _j_reduce(x):
    return (x**2).sum(-1) + x.mean() + (x**2 + 1).prod(-1)


def _t_full_sum(x):
    return torch.sum(torch.cos(x) * x)


def _j_full_sum(x):
    return jnp.sum(jnp.cos(x) * x)


# -- matmul and einsum ----------------------------------------------------------


def _t_matmul(a, b):
    return a @ b


def _j_matmul(a, b):
    return a @ b


def _t_einsum(a, b):
    return torch.einsum("bij,bj->bi", a, b) + torch.einsum("bij->i", a)


def _j_einsum(a, b):
    return jnp.einsum("bij,bj->bi", a, b) + jnp.einsum("bij->i", a)


# -- indexing and gather ------------------------------------------------------


def _t_slice(x):
    return x[..., 1:] * x[..., :1] + x[..., ::2].sum(-1, keepdim=True)


def _j_slice(x):
    return x[..., 1:] * x[..., :1] + x[..., ::2].sum(-1, keepdims=True)


def _t_gather(x, idx):
    return torch.gather(x, -1, idx.long()) ** 2


def _j_gather(x, idx):
    return jnp.take_along_axis(x, idx, axis=-1) ** 2


def _t_take(x, idx):
    return torch.sin(x[idx.long()])


def _j_take(x, idx):
    return jnp.sin(x[idx])


# -- softmax, logsumexp, norms ---------------------------------------------------


def _t_softmax(x):
    return torch.softmax(x, -1)


def _j_softmax(x):
    return jax.nn.softmax(x, axis=-1)


def _t_logsumexp(x):
    return torch.logsumexp(x, -1), torch.log_softmax(x, -1)


def _j_logsumexp(x):
    return jax.nn.logsumexp(x, axis=-1), jax.nn.log_softmax(x, axis=-1)


def _t_norms(x):
    # x has no zero entries, so no norm sits at its kink. The last dimension
    # by its positive index: torch 2.11's meta kernel keeps a size-1 dim=-1
    # that the real kernel drops, so shapes inferred on meta were wrong there
    # (the runtime names that: tests/test_bad_input.py).
    return torch.linalg.vector_norm(x, dim=x.dim() - 1) + torch.linalg.vector_norm(x, ord=3)


def _j_norms(x):
    return jnp.linalg.norm(x, axis=-1) + jnp.sum(jnp.abs(x) ** 3) ** (1 / 3)


# The ramp keeps every row's variance away from zero (x is in [-0.5, 0.5]),
# where the derivatives of layer_norm grow like eps**(-order/2).
def _t_layer_norm(x):
    x = x + 1.5 * torch.arange(x.shape[-1], dtype=x.dtype, device=x.device)
    return torch.nn.functional.layer_norm(x, x.shape[-1:], eps=1e-5)


def _j_layer_norm(x):
    x = x + 1.5 * jnp.arange(x.shape[-1], dtype=x.dtype)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5)


# -- linear algebra (well conditioned by construction) -------------------------------


def _t_solve(a, b):
    n = a.shape[-1]
    return torch.linalg.solve(a + 3 * torch.eye(n, dtype=a.dtype, device=a.device), b)


def _j_solve(a, b):
    n = a.shape[-1]
    return jnp.linalg.solve(a + 3 * jnp.eye(n, dtype=a.dtype), b)


def _t_cholesky(a):
    n = a.shape[-1]
    return torch.linalg.cholesky(a @ a.mT + n * torch.eye(n, dtype=a.dtype, device=a.device))


def _j_cholesky(a):
    n = a.shape[-1]
    return jnp.linalg.cholesky(a @ jnp.swapaxes(a, -1, -2) + n * jnp.eye(n, dtype=a.dtype))


# The fixed offset keeps the matrix away from multiples of the identity, where
# PyTorch's own second derivative of det is NaN (torch.func.hessian of
# det(a + 2 I) at a = 0, in torch 2.13; plain autograd is fine there).
def _t_det(a):
    n = a.shape[-1]
    offset = torch.arange(n * n, dtype=a.dtype, device=a.device).reshape(n, n) / (4 * n * n)
    return torch.linalg.det(a + 2 * torch.eye(n, dtype=a.dtype, device=a.device) + offset)


def _j_det(a):
    n = a.shape[-1]
    offset = jnp.arange(n * n, dtype=a.dtype).reshape(n, n) / (4 * n * n)
    return jnp.linalg.det(a + 2 * jnp.eye(n, dtype=a.dtype) + offset)


# -- where and clamp (kinks avoided by the domain) -------------------------------------


def _t_where(x, y):
    return torch.where(x > 0, x**2 * y, torch.sin(x) + y)


def _j_where(x, y):
    return jnp.where(x > 0, x**2 * y, jnp.sin(x) + y)


def _t_clamp(x):
    return torch.clamp(x, -1.0, 1.0) * x + torch.relu(x)


def _j_clamp(x):
    return jnp.clip(x, -1.0, 1.0) * x + jax.nn.relu(x)


# -- cumulative ------------------------------------------------------------------


def _t_cumsum(x):
    return torch.cumsum(torch.sin(x), -1) * x


def _j_cumsum(x):
    return jnp.cumsum(jnp.sin(x), -1) * x


def _t_cumprod(x):
    return torch.cumprod(x, -1), torch.logcumsumexp(x, -1)


def _j_cumprod(x):
    return jnp.cumprod(x, -1), jax.lax.cumlogsumexp(x, axis=x.ndim - 1)


# -- composite losses ------------------------------------------------------------


def _t_cross_entropy(logits, target):
    return torch.nn.functional.cross_entropy(logits, target.long())


def _j_cross_entropy(logits, target):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, target[:, None], axis=-1))


def _t_mse(x, y):
    return torch.nn.functional.mse_loss(x, y)


def _j_mse(x, y):
    return jnp.mean((x - y) ** 2)


def _t_mlp(x, w1, w2):
    return torch.tanh(x @ w1) @ w2


def _j_mlp(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2


PAIRS: tuple[Pair, ...] = (
    Pair("exp_tanh", _t_exp_tanh, _j_exp_tanh, (REAL, REAL), _same(*ANY)),
    Pair("log_sqrt", _t_log_sqrt, _j_log_sqrt, (POSITIVE,), _same(*ANY, n=1)),
    Pair("div_pow", _t_div_pow, _j_div_pow, (REAL, POSITIVE), _same((), (3,), (1, 3))),
    Pair("broadcast", _t_broadcast, _j_broadcast, (REAL, REAL), (((2, 3), (3,)), ((3,), ()), ((1, 3), (1,)))),
    Pair("reduce", _t_reduce, _j_reduce, (REAL,), _same(*VECTORS, n=1), jax_jet=False),
    Pair("full_sum", _t_full_sum, _j_full_sum, (REAL,), _same((), (1,), (2, 3), n=1)),
    Pair("matmul", _t_matmul, _j_matmul, (REAL, REAL), (((2, 3), (3, 2)), ((3,), (3, 1)), ((1, 3), (3,)))),
    Pair("einsum", _t_einsum, _j_einsum, (REAL, REAL), (((2, 2, 3), (2, 3)), ((1, 3, 1), (1, 1)))),
    Pair("slice", _t_slice, _j_slice, (REAL,), _same((3,), (2, 3), (1, 2), n=1)),
    Pair("gather", _t_gather, _j_gather, (REAL, index(3)), (((2, 3), (2, 2)), ((3,), (4,)), ((1, 3), (1, 1)))),
    # No 0-d index: torch.vmap treats indexing by a 0-d tensor as .item().
    Pair("take", _t_take, _j_take, (REAL, index(3)), (((3,), (1,)), ((3, 2), (2,)), ((3,), (1, 2)))),
    Pair("softmax", _t_softmax, _j_softmax, (REAL,), _same(*VECTORS, n=1)),
    Pair("logsumexp", _t_logsumexp, _j_logsumexp, (REAL,), _same(*VECTORS, n=1)),
    # torch.func cannot take a third derivative of vector_norm: its backward
    # writes in place (torch 2.13: torch.func.grad(torch.func.hessian(norm))
    # raises "modified by an inplace operation ... MaskedFill").
    Pair("norms", _t_norms, _j_norms, (AWAY_FROM_ZERO,), _same(*VECTORS, n=1), max_order=2),
    # torch 2.13: torch.func's second derivatives of layer_norm are wrong
    # (pytorch/pytorch#196700); t2j_ad computes calls of order two and up by
    # plain ops (NOTE [normalizations at second order]), so they are drawn.
    Pair("layer_norm", _t_layer_norm, _j_layer_norm, (SMALL,), _same((3,), (2, 3), n=1), max_order=3),
    # torch 2.13: derivatives of the forward-mode formulas of linalg.solve and
    # linalg.det are wrong (torch.func.jvp of torch.func.jvp, and vjp of jvp,
    # disagree with finite differences; t2j_ad returns what torch.func does;
    # see test_check_grads.py). Reverse over forward is never drawn for them.
    # Like det below, vmap of jacfwd of solve with respect to the matrix is
    # wrong past the first batch element (torch 2.13 and 2.14).
    Pair(
        "solve", _t_solve, _j_solve, (SMALL, REAL), (((3, 3), (3,)), ((2, 2), (2, 3)), ((1, 1), (1,))),
        differentiable_jvp=False, batchable_jvp=False, jax_jet=False,
    ),
    Pair("cholesky", _t_cholesky, _j_cholesky, (SMALL,), _same((3, 3), (2, 2), (1, 1), n=1), jax_jet=False),
    # torch.func's third derivative of det is NaN (torch 2.13; plain autograd is right).
    # torch 2.11-2.14: torch.func.vmap(torch.func.jacfwd(torch.linalg.det))
    # over a batch of matrices is wrong past the first (the inner vmap leaves
    # the primal unbatched; vmap of jacrev is right). vmap_method
    # "broadcast_all" or "sequential" gives the right values
    # (test_transforms.py, docs/transforms.md).
    Pair(
        "det", _t_det, _j_det, (SMALL,), _same((3, 3), (2, 2), (1, 1), n=1),
        max_order=2, differentiable_jvp=False, batchable_jvp=False, jax_jet=False,
    ),
    Pair("where", _t_where, _j_where, (AWAY_FROM_ZERO, REAL), _same(*ANY)),
    Pair(
        "clamp", _t_clamp, _j_clamp, (Domain(-2.0, 2.0, avoid=(-1.0, 0.0, 1.0)),), _same(*ANY, n=1), jax_jet=False
    ),
    Pair("cumsum", _t_cumsum, _j_cumsum, (REAL,), _same(*VECTORS, n=1)),
    # torch 2.13: torch.func's third derivative of logcumsumexp over one
    # element is NaN (grad of grad of grad at x = [1.0]; the math gives 0).
    Pair("cumprod", _t_cumprod, _j_cumprod, (POSITIVE,), _same(*VECTORS, n=1), max_order=2, jax_jet=False),
    Pair("cross_entropy", _t_cross_entropy, _j_cross_entropy, (REAL, index(3)), (((2, 3), (2,)), ((1, 3), (1,)))),
    # torch 2.13-2.14: torch.vmap of mse_loss under two vmaps that batch its
    # two arguments at different levels fails ("The size of tensor a (6) must
    # match the size of tensor b (3)"), and at batch size 1 returns the wrong
    # shape (test_batching.py holds auto's fallback on such a rule).
    Pair("mse", _t_mse, _j_mse, (REAL, REAL), _same((), (3,), (2, 3)), vmap_across_levels=False),
    Pair("mlp", _t_mlp, _j_mlp, (REAL, SMALL, SMALL), (((2, 3), (3, 4), (4, 2)), ((3,), (3, 2), (2,)))),
)

PAIRS_BY_NAME = {p.name: p for p in PAIRS}


@functools.lru_cache(maxsize=None)
def torch_version(pair: Pair, vmap_method: str = "auto") -> Callable[..., object]:
    """``t2j_ad.jaxify(pair.torch_fn)``, one per pair and method, so the
    signature cache and the built PyTorch transforms are reused."""
    return t2j_ad.jaxify(pair.torch_fn, vmap_method=vmap_method)
