# %% [markdown]
# # Newton's method on a PyTorch loss, with `jax.hessian`
#
# Newton's method needs the Hessian, the matrix of second derivatives of the
# loss. In PyTorch that means `torch.func.hessian` and rewriting the training
# step around it; in JAX it is one call, `jax.hessian`. `t2j_ad.jaxify` turns a
# PyTorch function into a JAX function, so the PyTorch loss can stay exactly as
# it is while JAX computes its gradient, its Hessian and runs the optimiser
# under `jax.jit`.
#
# The problem: a softmax (multinomial logistic) regression, written in
# PyTorch with `torch.nn.functional.cross_entropy`. We minimise it two ways:
#
# * **gradient descent**, which only uses the gradient and takes small, safe
#   steps;
# * **Newton's method**, which models the loss as a quadratic around the
#   current point (gradient plus Hessian) and jumps straight to the minimum of
#   that quadratic.
#
# Then we look at the Hessian's eigenvalues, which explain why one method is so
# much faster than the other, and check the Hessian against
# `torch.func.hessian`.

# %%
# %matplotlib inline
import pathlib
import sys

# Run from a source checkout without installing t2j_ad: put the repository root on the path.
for folder in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]:
    if (folder / "t2j_ad" / "__init__.py").is_file():
        sys.path.insert(0, str(folder))
        break

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import scipy.optimize
import torch
import torch.nn.functional as F

import t2j_ad

# Newton's method converges to machine precision; float64 lets us see it.
jax.config.update("jax_enable_x64", True)
torch.set_default_dtype(torch.float64)

# %% [markdown]
# ## The data and the PyTorch loss
#
# Three classes of points in four dimensions, drawn from a known linear model
# with label noise (Gumbel noise on the class scores), so the classes overlap and the loss has a finite minimum. A
# small ridge penalty $\frac{\lambda}{2}\|w\|^2$ makes the minimum unique (the
# softmax is unchanged when the same number is added to every class's score,
# so without it the Hessian would be singular).
#
# The parameters are one flat vector `w` (the weight matrix and the biases), so
# that the Hessian is a plain matrix.

# %%
n_samples, n_features, n_classes = 300, 4, 3
ridge = 1e-3
rng = np.random.default_rng(0)

# Features on very different scales, as raw measurements often are: this is
# what makes the problem hard for gradient descent (see the eigenvalues below).
feature_scales = np.array([3.0, 1.0, 0.3, 0.1])
X = rng.normal(size=(n_samples, n_features)) * feature_scales
true_weights = rng.normal(size=(n_features, n_classes)) / feature_scales[:, None]
noisy_scores = X @ true_weights + rng.gumbel(size=(n_samples, n_classes))
y = noisy_scores.argmax(axis=1)
n_params = n_features * n_classes + n_classes


def logistic_loss(w, X, y):
    """Mean cross-entropy of a linear softmax classifier, plus a ridge penalty (PyTorch)."""
    weights = w[: n_features * n_classes].reshape(n_features, n_classes)
    biases = w[n_features * n_classes :]
    logits = X @ weights + biases
    return F.cross_entropy(logits, y) + 0.5 * ridge * (w @ w)


print(f"{n_samples} samples, {n_params} parameters, class counts {np.bincount(y)}")

# %% [markdown]
# ## From PyTorch to JAX
#
# `t2j_ad.jaxify` wraps the function; JAX transforms then apply to it as to any
# JAX function. `jax.hessian` differentiates with respect to the first argument
# (`w`); the data `X`, `y` are plain inputs. Everything is compiled with
# `jax.jit`: XLA calls back into PyTorch for the loss and for each derivative.

# %%
loss = t2j_ad.jaxify(logistic_loss)
loss_and_grad = jax.jit(jax.value_and_grad(loss))
hessian = jax.jit(jax.hessian(loss))

X_jax, y_jax = jnp.asarray(X), jnp.asarray(y)
w0 = jnp.zeros(n_params)
value, gradient = loss_and_grad(w0, X_jax, y_jax)
print("loss at w = 0:", float(value), " (log 3 =", np.log(3), ")")
print("Hessian shape:", hessian(w0, X_jax, y_jax).shape)

# %% [markdown]
# ## A reference minimum
#
# To judge both methods we need the true minimum. SciPy's BFGS, fed directly by
# PyTorch's own autograd (no JAX involved), gives an independent one.

# %%
X_torch, y_torch = torch.from_numpy(X), torch.from_numpy(y)


def torch_loss_and_grad(w):
    w = torch.tensor(w, requires_grad=True)
    value = logistic_loss(w, X_torch, y_torch)
    value.backward()
    return value.item(), w.grad.numpy()


reference = scipy.optimize.minimize(
    torch_loss_and_grad, np.zeros(n_params), jac=True, method="BFGS", options={"gtol": 1e-12}
)
loss_star = reference.fun
print("reference minimum:", loss_star, " gradient norm:", np.linalg.norm(reference.jac))

# %% [markdown]
# ## Gradient descent and Newton's method
#
# **Gradient descent** steps $w \leftarrow w - \frac{1}{L} \nabla f(w)$, where
# $L$ bounds the curvature. For softmax cross-entropy a safe bound is
# $L = \tfrac12 \lambda_{\max}(\tilde X^\top \tilde X / n) + \lambda$, with
# $\tilde X$ the inputs with a column of ones for the bias; with that step the
# loss never goes up.
#
# **Newton's method** solves $H(w)\,\delta = \nabla f(w)$ and steps
# $w \leftarrow w - \delta$. Close to the minimum the error squares at every
# step (quadratic convergence), so a handful of steps reach machine precision.
# The loss here is smooth and convex, so plain Newton from $w = 0$ needs no
# line search.

# %%
X_with_ones = np.hstack([X, np.ones((n_samples, 1))])
curvature_bound = 0.5 * np.linalg.eigvalsh(X_with_ones.T @ X_with_ones / n_samples).max() + ridge


@jax.jit
def gradient_descent_step(w):
    value, gradient = loss_and_grad(w, X_jax, y_jax)
    return w - gradient / curvature_bound, value


@jax.jit
def newton_step(w):
    value, gradient = loss_and_grad(w, X_jax, y_jax)
    return w - jnp.linalg.solve(hessian(w, X_jax, y_jax), gradient), value


def run(step, n_steps):
    """Losses before each of ``n_steps`` steps and after the last, and the final point."""
    w, losses = w0, []
    for _ in range(n_steps):
        w, value = step(w)
        losses.append(float(value))
    losses.append(float(loss(w, X_jax, y_jax)))
    return w, np.array(losses)


w_gd, gd_losses = run(gradient_descent_step, 300)
w_newton, newton_losses = run(newton_step, 8)

for i, value in enumerate(newton_losses):
    print(f"Newton iteration {i}: loss - minimum = {value - loss_star: .3e}")
print(f"gradient descent after 300 steps: loss - minimum = {gd_losses[-1] - loss_star:.3e}")

# %% [markdown]
# The gap to the minimum on a log scale: gradient descent's gap shrinks by a
# roughly constant factor per step (a straight line), Newton's collapses
# after a few steps (the curve falls off a cliff) until it hits rounding error.

# %%
floor = 1e-16  # gaps at or below rounding error are drawn at this level
fig, ax = plt.subplots(figsize=(7, 4))
ax.semilogy(np.maximum(gd_losses - loss_star, floor), label="gradient descent (step 1/L)")
ax.semilogy(np.maximum(newton_losses - loss_star, floor), "o-", label="Newton's method")
ax.set_xlabel("iteration")
ax.set_ylabel("loss − minimum")
ax.set_title("Softmax regression in PyTorch, optimised from JAX")
ax.legend()
plt.show()

# %% [markdown]
# The checks: Newton reaches the reference minimum to rounding error in 8 steps,
# with a vanishing gradient; gradient descent never increases the loss (the
# curvature bound is a true bound) but is still far from the minimum after 300
# steps.

# %%
_, newton_gradient = loss_and_grad(w_newton, X_jax, y_jax)
assert abs(newton_losses[-1] - loss_star) < 1e-12, newton_losses[-1] - loss_star
assert np.linalg.norm(newton_gradient) < 1e-10, np.linalg.norm(newton_gradient)
np.testing.assert_allclose(w_newton, reference.x, atol=1e-6)
assert np.all(np.diff(gd_losses) <= 1e-15), "gradient descent increased the loss"
assert gd_losses[-1] - loss_star > 1e3 * (newton_losses[-1] - loss_star + 1e-16)

# %% [markdown]
# ## The Hessian's eigenvalues
#
# At the minimum the Hessian is symmetric positive definite: every eigenvalue
# is at least the ridge $\lambda$. Its spread, the condition number
# $\kappa = \lambda_{\max}/\lambda_{\min}$, is what slows gradient descent: each
# step can only shrink the error along the flattest direction by about
# $1 - \lambda_{\min}/L$. Newton's method rescales every direction by its own
# curvature, so it does not care about $\kappa$.
#
# Five eigenvalues equal $\lambda$ exactly. Their eigenvectors add the same
# amount to every class's weight for one feature (or to every bias), which
# leaves the softmax unchanged: only the ridge penalty curves the loss along
# them. The other eigenvalues spread over about three orders of magnitude
# because the features do.

# %%
H_star = np.asarray(hessian(w_newton, X_jax, y_jax))
eigenvalues = np.linalg.eigvalsh(H_star)
print("eigenvalues:", np.array2string(eigenvalues, precision=4))
print(f"condition number: {eigenvalues.max() / eigenvalues.min():.1f}")
print(f"curvature bound L = {curvature_bound:.4f} >= largest eigenvalue {eigenvalues.max():.4f}")

assert np.allclose(H_star, H_star.T, atol=1e-14), "Hessian is not symmetric"
assert eigenvalues.min() >= ridge * (1 - 1e-9), "Hessian is not positive definite beyond the ridge"
assert eigenvalues.max() <= curvature_bound
assert np.sum(np.isclose(eigenvalues, ridge, rtol=1e-8)) == n_features + 1, "expected one flat direction per feature and bias"

fig, ax = plt.subplots(figsize=(7, 3))
ax.semilogy(eigenvalues, "s")
ax.axhline(ridge, color="gray", linestyle="--", label="ridge λ")
ax.axhline(curvature_bound, color="gray", linestyle=":", label="curvature bound L")
ax.set_xlabel("index")
ax.set_ylabel("eigenvalue")
ax.set_title("Spectrum of the Hessian at the minimum")
ax.legend()
plt.show()

# %% [markdown]
# ## Agreement with `torch.func.hessian`
#
# The same Hessian computed entirely in PyTorch, by `torch.func.hessian`
# (forward-over-reverse in `torch.func`), must match JAX's to rounding error.

# %%
H_torch = torch.func.hessian(logistic_loss)(torch.tensor(np.asarray(w_newton)), X_torch, y_torch)
difference = np.abs(H_star - H_torch.numpy()).max()
print(f"largest difference between jax.hessian and torch.func.hessian: {difference:.2e}")
np.testing.assert_allclose(H_star, H_torch.numpy(), rtol=1e-10, atol=1e-12)
