# %% [markdown]
# # Per-example gradients of a PyTorch model, with `jax.vmap(jax.grad(...))`
#
# A training step usually needs the gradient of the *mean* loss over a batch.
# Some methods need the gradient of *each example's* loss separately:
# differentially private SGD (DP-SGD) clips each one, influence functions and
# gradient-noise diagnostics study their spread. Looping over the batch is
# slow; JAX writes it as `jax.vmap(jax.grad(loss))`: the gradient of one
# example's loss, vectorised over the batch.
#
# `t2j_ad.jaxify_module` turns a PyTorch `nn.Module` into a pure function
# `apply(params, x)` with its parameters as a dict of JAX arrays, so the model
# stays in PyTorch and the training loop is written in JAX.
#
# This notebook:
#
# 1. computes per-example gradients of a small PyTorch MLP and checks them
#    against `torch.func`;
# 2. trains the classifier with DP-SGD (per-example clipping plus Gaussian
#    noise) and plots the per-example gradient norms;
# 3. times the three ways t2j_ad can hand a batch to PyTorch (`vmap_method`)
#    against `torch.func.vmap(torch.func.grad(...))`.

# %%
# %matplotlib inline
import pathlib
import sys
import time

# Run from a source checkout without installing t2j_ad: put the repository root on the path.
for folder in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]:
    if (folder / "t2j_ad" / "__init__.py").is_file():
        sys.path.insert(0, str(folder))
        break

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import t2j_ad

# %% [markdown]
# ## Data and model
#
# Two interleaved half-moons in the plane (two classes), and a PyTorch MLP with
# one hidden layer. Everything is float32, as in everyday training.

# %%
def make_moons(n_samples, noise, rng):
    """Two interleaved half circles, labels 0 and 1."""
    angle = rng.uniform(0, np.pi, n_samples)
    label = rng.integers(0, 2, n_samples)
    x = np.where(label == 0, np.cos(angle), 1 - np.cos(angle))
    y = np.where(label == 0, np.sin(angle), 0.5 - np.sin(angle))
    points = np.stack([x, y], axis=1) + noise * rng.normal(size=(n_samples, 2))
    return points.astype(np.float32), label.astype(np.int32)


rng = np.random.default_rng(0)
X_train, y_train = make_moons(1024, noise=0.1, rng=rng)

torch.manual_seed(0)  # the model's initial weights
model = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 2))
apply, initial_params = t2j_ad.jaxify_module(model)
print({name: value.shape for name, value in initial_params.items()})

# %% [markdown]
# ## Per-example gradients
#
# `example_loss` is the cross-entropy of **one** example: the PyTorch model is
# called on a single point `x` (shape `(2,)`; `nn.Linear` accepts unbatched
# input). `jax.grad` gives its gradient with respect to the parameters, and
# `jax.vmap` maps that over the batch (`in_axes=(None, 0, 0)`: the same
# parameters for every example, one row of `x` and `y` each). The result has the
# structure of the parameters with a leading batch axis.

# %%
def make_per_example_grads(apply):
    def example_loss(params, x, y):
        logits = apply(params, x)
        return -jax.nn.log_softmax(logits)[y]

    return jax.jit(jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0)))


per_example_grads = make_per_example_grads(apply)

x_batch, y_batch = jnp.asarray(X_train[:256]), jnp.asarray(y_train[:256])
grads = per_example_grads(initial_params, x_batch, y_batch)
print({name: g.shape for name, g in grads.items()})

# %% [markdown]
# ### Reference: `torch.func`
#
# PyTorch's own answer to the same question is
# `torch.func.vmap(torch.func.grad(...))` with `torch.func.functional_call`.
# The two must agree to float32 rounding.

# %%
def torch_example_loss(params, x, y):
    logits = torch.func.functional_call(model, params, (x,))
    return F.cross_entropy(logits[None], y[None].long())


torch_per_example_grads = torch.func.vmap(torch.func.grad(torch_example_loss), in_dims=(None, 0, 0))
torch_params = {name: p.detach() for name, p in model.named_parameters()}
x_batch_torch, y_batch_torch = torch.from_numpy(X_train[:256]), torch.from_numpy(y_train[:256])
torch_grads = torch_per_example_grads(torch_params, x_batch_torch, y_batch_torch)

for name in torch_grads:
    np.testing.assert_allclose(grads[name], torch_grads[name].numpy(), rtol=1e-5, atol=1e-6)
print("per-example gradients match torch.func for", list(torch_grads))

# %% [markdown]
# ## DP-SGD: clip each example's gradient, then add noise
#
# DP-SGD (Abadi et al., 2016) bounds how much any single example can move the
# model:
#
# 1. compute each example's gradient $g_i$;
# 2. clip it to norm at most $C$: $\bar g_i = g_i \cdot \min(1, C/\|g_i\|)$,
#    where $\|g_i\|$ is the norm over *all* parameters together;
# 3. sum the clipped gradients, add Gaussian noise with standard deviation
#    $\sigma C$, divide by the batch size, and take an SGD step.
#
# Clipping needs the per-example gradients, which is why `vmap(grad)` matters
# here. (The privacy guarantee, $(\varepsilon, \delta)$, follows from $\sigma$,
# the sampling rate and the number of steps through a privacy accountant; that
# bookkeeping is not part of this notebook.)

# %%
clip_norm = 1.0  # C
noise_multiplier = 1.0  # sigma
learning_rate = 0.5
batch_size = 64
n_steps = 300


def per_example_norms(grads):
    """The norm of each example's gradient over all parameters: shape (batch,)."""
    squares = [jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree.leaves(grads)]
    return jnp.sqrt(sum(squares))


def clip(grads):
    """Scale each example's gradient down to norm at most clip_norm."""
    scale = jnp.minimum(1.0, clip_norm / (per_example_norms(grads) + 1e-12))
    return jax.tree.map(lambda g: g * scale.reshape((-1,) + (1,) * (g.ndim - 1)), grads)


@jax.jit
def dp_sgd_step(params, x, y, key):
    clipped = clip(per_example_grads(params, x, y))
    keys = dict(zip(params, jax.random.split(key, len(params))))
    noisy_mean = {
        name: (g.sum(axis=0) + noise_multiplier * clip_norm * jax.random.normal(keys[name], g.shape[1:])) / x.shape[0]
        for name, g in clipped.items()
    }
    return {name: params[name] - learning_rate * noisy_mean[name] for name in params}


def accuracy(params, x, y):
    return float(jnp.mean(jnp.argmax(apply(params, x), axis=1) == y))


params, key = initial_params, jax.random.key(0)
X_jax, y_jax = jnp.asarray(X_train), jnp.asarray(y_train)
history = []
for step in range(n_steps):
    key, batch_key, noise_key = jax.random.split(key, 3)
    batch = jax.random.choice(batch_key, len(X_train), (batch_size,), replace=False)
    params = dp_sgd_step(params, X_jax[batch], y_jax[batch], noise_key)
    if step % 50 == 0 or step == n_steps - 1:
        history.append((step, accuracy(params, X_jax, y_jax)))

for step, acc in history:
    print(f"step {step:3d}: training accuracy {acc:.3f}")
print(f"accuracy before training: {accuracy(initial_params, X_jax, y_jax):.3f}")

# %% [markdown]
# The model learns despite the clipping and the noise. The check below also
# confirms that clipping does what it says: after `clip`, no example's gradient
# is longer than $C$, and short gradients are left untouched.

# %%
final_accuracy = accuracy(params, X_jax, y_jax)
assert final_accuracy > 0.85, final_accuracy

norms_before = per_example_norms(per_example_grads(initial_params, X_jax, y_jax))
norms_after = per_example_norms(per_example_grads(params, X_jax, y_jax))
clipped_norms = per_example_norms(clip(per_example_grads(params, X_jax, y_jax)))
assert float(clipped_norms.max()) <= clip_norm * (1 + 1e-5)
short = norms_after < clip_norm
np.testing.assert_allclose(clipped_norms[short], norms_after[short], rtol=1e-6)
print(f"examples clipped after training: {float(jnp.mean(norms_after > clip_norm)):.1%}")

# %% [markdown]
# ### The per-example gradient norms
#
# The histogram shows the distribution of $\|g_i\|$ over the training set,
# before and after training, with the clipping threshold $C$. After training,
# most examples are fit well and have small gradients; the long tail is the
# examples the model still gets wrong, and those are the ones clipping limits.

# %%
fig, ax = plt.subplots(figsize=(7, 4))
bins = np.logspace(np.log10(float(norms_after.min())) - 0.1, np.log10(float(norms_before.max())) + 0.1, 40)
ax.hist(np.asarray(norms_before), bins=bins, alpha=0.6, label="at initialisation")
ax.hist(np.asarray(norms_after), bins=bins, alpha=0.6, label="after DP-SGD")
ax.axvline(clip_norm, color="black", linestyle="--", label="clipping threshold C")
ax.set_xscale("log")
ax.set_xlabel("per-example gradient norm ‖g_i‖")
ax.set_ylabel("number of examples")
ax.legend()
plt.show()

# %% [markdown]
# ## How the batch reaches PyTorch: timing the `vmap_method`s
#
# Under `jax.vmap`, t2j_ad can hand the batch to PyTorch in three ways:
#
# * `"sequential"`: call the per-example PyTorch function once per example (a
#   Python loop; works for any code, even code `torch.vmap` cannot trace);
# * `"expand_dims"`: one call of `torch.vmap(...)`, with the unbatched
#   parameters passed once;
# * `"broadcast_all"`: one call of `torch.vmap(...)`, with the parameters first
#   broadcast to the batch size (an expanded view, not a copy).
#
# We time the jitted per-example gradients for a batch of 256 with each, and
# `torch.func.vmap(torch.func.grad(...))` run eagerly in PyTorch, taking the
# median of several runs after a warm-up (the first call compiles). Every method
# must give the same gradients.

# %%
def median_seconds(fn, repeats=7):
    jax.block_until_ready(fn())  # warm-up: compile, infer shapes
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


timings = {}
for method in ["sequential", "expand_dims", "broadcast_all"]:
    method_apply, method_params = t2j_ad.jaxify_module(model, vmap_method=method)
    method_grads = make_per_example_grads(method_apply)
    for name, g in method_grads(method_params, x_batch, y_batch).items():
        np.testing.assert_allclose(g, torch_grads[name].numpy(), rtol=1e-5, atol=1e-6, err_msg=method)
    timings[f"t2j_ad\n{method}"] = median_seconds(lambda: method_grads(method_params, x_batch, y_batch))

timings["torch.func\nvmap(grad)"] = median_seconds(
    lambda: torch_per_example_grads(torch_params, x_batch_torch, y_batch_torch)
)
for name, seconds in timings.items():
    print(f"{name.replace(chr(10), ' '):28s} {seconds * 1e3:8.2f} ms")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
bars = ax.bar(list(timings), [t * 1e3 for t in timings.values()], color=["C3", "C0", "C1", "C2"])
ax.bar_label(bars, fmt="%.2f ms")
ax.set_yscale("log")
ax.set_ylabel("time per batch of 256 (ms, log scale)")
ax.set_title("Per-example gradients of a PyTorch MLP")
plt.show()

# %% [markdown]
# `sequential` makes one PyTorch call per example, so it is slower by roughly
# the batch size; the two `torch.vmap` methods make a single call and cost
# about as much as `torch.func` itself (plus a small fixed overhead for
# crossing from XLA into PyTorch). The measured speed-up on this machine:

# %%
speedup = timings["t2j_ad\nsequential"] / timings["t2j_ad\nexpand_dims"]
print(f"expand_dims is {speedup:.0f}x faster than sequential at batch {len(x_batch)}")
