"""A name the function reads, bound to another module or function after its
signature was resolved (NOTE [a name rebound after a call]): held against
``torch.func`` on the same draws and PyTorch's own batch-norm updates."""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.func
from conftest import TORCH_DEVICE, assert_tree_allclose, count_resolutions, to_numpy, to_torch

import t2j_ad
from t2j_ad import graph_mode
from t2j_ad.named_bindings import BindingsSeen

pytestmark = pytest.mark.usefixtures("x64")

# Under T2J_AD_COMPILE=graph (or inductor) a graph replays no Python: a
# number or a plain attribute the function reads is read once per trace
# (docs/compile-modes.md, "Other Python state your function reads").
READ_ONCE_PER_TRACE = graph_mode.resolve_compile_mode(None, "jaxify") != "eager"

model = torch.nn.Identity()
models = {"encoder": torch.nn.Identity()}


def noise(x):
    return x


def _square_sum(fn):
    return lambda x: (fn(x) ** 2).sum()


def _against_torch_func(f, reference, x, seed=0):
    """``jax.value_and_grad(f)`` against ``torch.func.grad_and_value`` of
    ``reference``, both from ``seed``: the same mask in value and gradient."""
    torch.manual_seed(seed)
    value, grad = jax.value_and_grad(f)(x)
    torch.manual_seed(seed)
    expected_grad, expected_value = torch.func.grad_and_value(reference)(to_torch(x))
    assert_tree_allclose((value, grad), (to_numpy(expected_value), to_numpy(expected_grad)))


@pytest.fixture
def resolved(monkeypatch):
    """One entry per signature resolved during the test."""
    return count_resolutions(monkeypatch)


@pytest.fixture
def rebound():
    """Put the module-level names back after the test."""
    global model, noise
    saved = model, dict(models), noise
    yield
    model, noise = saved[0], saved[2]
    models.clear()
    models.update(saved[1])


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_global_module_rebound_to_dropout_draws_one_mask_for_value_and_gradient(mode, rebound):
    global model
    model = torch.nn.Identity()
    f = t2j_ad.jaxify(lambda x: (model(x) ** 2).sum(), compile=mode)
    x = jnp.arange(1.0, 9.0)
    assert_tree_allclose(jax.grad(f)(x), 2 * x)
    model = torch.nn.Dropout(0.5).to(TORCH_DEVICE)  # the next cell
    _against_torch_func(f, lambda t: (model(t) ** 2).sum(), x)


def test_a_helper_defined_again_to_draw_draws_one_mask(rebound):
    global noise

    def noise(x):  # noqa: F811 - as a notebook cell defines it
        return x

    f = t2j_ad.jaxify(lambda x: (noise(x) ** 2).sum())
    x = jnp.arange(1.0, 9.0)
    assert_tree_allclose(jax.grad(f)(x), 2 * x)

    def noise(x):  # noqa: F811 - the cell run again, edited
        return torch.nn.functional.dropout(x, 0.5)

    _against_torch_func(f, lambda t: (noise(t) ** 2).sum(), x)


def test_an_entry_of_a_dict_and_a_closure_variable_rebound_are_seen(rebound):
    f = t2j_ad.jaxify(lambda x: (models["encoder"](x) ** 2).sum())
    inner = torch.nn.Identity()

    def make():
        def loss(x):
            return (inner(x) ** 2).sum()

        return loss

    g = t2j_ad.jaxify(make())
    x = jnp.arange(1.0, 9.0)
    for h in (f, g):
        assert_tree_allclose(jax.grad(h)(x), 2 * x)
    models["encoder"] = torch.nn.Dropout(0.5).to(TORCH_DEVICE)
    _against_torch_func(f, lambda t: (models["encoder"](t) ** 2).sum(), x)
    inner = torch.nn.Dropout(0.5).to(TORCH_DEVICE)  # noqa: F841 - the closure reads it
    _against_torch_func(g, lambda t: (inner(t) ** 2).sum(), x, seed=1)


def test_a_global_rebound_to_a_batch_norm_updates_its_statistics_once_per_call(rebound):
    global model
    model = torch.nn.Identity()
    f = t2j_ad.jaxify(lambda x: (model(x) ** 2).sum())
    x = jnp.arange(12.0).reshape(4, 3)
    jax.grad(f)(x)
    model = torch.nn.BatchNorm1d(3, dtype=torch.float64).to(TORCH_DEVICE)
    twin = torch.nn.BatchNorm1d(3, dtype=torch.float64).to(TORCH_DEVICE)
    for _ in range(2):
        t = to_torch(x).requires_grad_()
        (expected,) = torch.autograd.grad((twin(t) ** 2).sum(), t)
        assert_tree_allclose(jax.grad(f)(x), to_numpy(expected), atol=1e-9)
    assert int(model.num_batches_tracked) == int(twin.num_batches_tracked) == 2
    assert_tree_allclose(to_numpy(model.running_mean), to_numpy(twin.running_mean))


def test_a_rebound_number_does_not_resolve_again(resolved):
    scale = 1.0
    f = t2j_ad.jaxify(lambda x: x * scale)
    for k in range(4):
        scale = float(k)
        # a graph keeps the number its trace read, in the first call (0.0)
        assert float(f(jnp.ones(()))) == (0.0 if READ_ONCE_PER_TRACE else k)
    assert len(resolved) == 1


def test_under_jit_a_rebinding_that_changes_the_draws_is_refused_until_traced_again(rebound):
    global noise
    f = jax.jit(jax.value_and_grad(t2j_ad.jaxify(lambda x: (noise(x) ** 2).sum())))
    x = jnp.arange(1.0, 9.0)
    assert_tree_allclose(f(x)[1], 2 * x)

    def noise(x):  # noqa: F811 - defined again to draw
        return torch.nn.functional.dropout(x, 0.5)

    with pytest.raises(Exception, match="a name it reads now holds another module, function or state tensor"):
        jax.block_until_ready(f(x))  # on a GPU the call's error comes when it has run
    g = t2j_ad.jaxify(lambda x: (noise(x) ** 2).sum())
    _against_torch_func(jax.jit(g), lambda t: (noise(t) ** 2).sum(), x)


def test_bindings_seen_are_the_names_on_the_way_to_modules_and_callables(rebound):
    count = 3
    weights = torch.ones(2)

    def f(x):
        return model(x) * count + noise(x) * weights + models["encoder"](x) + torch.sin(x)

    seen = BindingsSeen(f)
    # model, noise, models, models["encoder"], the code of noise and f, and
    # a forward set later on either module: not count, weights or torch
    assert len(seen) == 8
    assert seen.hold()
    count, weights = 4, torch.zeros(2)  # noqa: F841 - numbers and tensors: not remembered
    models["other"] = torch.nn.Identity()  # another entry: nothing f reads
    assert seen.hold()
    models["encoder"] = torch.nn.Identity()
    assert not seen.hold()
    again = BindingsSeen(f)
    code = noise.__code__
    noise.__code__ = (lambda x: x * 1).__code__  # as IPython's %autoreload edits a function in place
    try:
        assert not again.hold()
    finally:
        noise.__code__ = code


class _CallsAGlobal(torch.nn.Module):
    def forward(self, x):
        return (noise(x) ** 2).sum()


def test_a_helper_a_modules_forward_calls_defined_again_is_seen(rebound):
    global noise
    net = _CallsAGlobal()
    f = t2j_ad.jaxify(net)
    x = jnp.arange(1.0, 9.0)
    assert_tree_allclose(jax.grad(f)(x), 2 * x)

    def noise(x):  # noqa: F811 - the helper's cell run again, edited
        return torch.nn.functional.dropout(x, 0.5)

    _against_torch_func(f, lambda t: net(t), x)


def test_a_module_or_its_bound_forward_remembers_only_a_forward_set_on_it():
    # Its submodules are NOTE [a submodule replaced after a call]'s business.
    linear = torch.nn.Linear(2, 2)
    seen, bound = BindingsSeen(linear), BindingsSeen(linear.forward)
    assert len(seen) == len(bound) == 1 and seen.hold() and bound.hold()
    linear.forward = lambda x: x
    assert not seen.hold() and not bound.hold()


def test_a_state_tensor_bound_afresh_by_name_is_updated_once_per_step():
    # A running sum kept in a global-like name; a later cell starts a fresh
    # one: value_and_grad updated the new tensor twice (value and derivative
    # call) and returned the gradient of the twice-updated state.
    state = {"acc": torch.zeros(3, dtype=torch.float64, device=TORCH_DEVICE)}

    def running(t):
        state["acc"].add_(t.detach())
        return (t * state["acc"]).sum()

    f = t2j_ad.jaxify(running)
    x = jnp.array([1.0, 2.0, 3.0])
    jax.value_and_grad(f)(x)
    state["acc"] = torch.full((3,), 10.0, dtype=torch.float64, device=TORCH_DEVICE)
    twin = torch.full((3,), 10.0, dtype=torch.float64, device=TORCH_DEVICE)
    for _ in range(2):
        value, grad = jax.value_and_grad(f)(x)
        twin.add_(to_torch(x))
        assert_tree_allclose((value, grad), (float((to_torch(x) * twin).sum()), to_numpy(twin)))
    assert_tree_allclose(to_numpy(state["acc"]), to_numpy(twin))
    numbers = {"step": 0}
    g = t2j_ad.jaxify(lambda t: t * numbers["step"])  # no state: numbers bound afresh are no change
    for k in range(3):
        numbers["step"] = k
        assert_tree_allclose(g(x), x * (0 if READ_ONCE_PER_TRACE else k))  # a graph: the trace's number


class _KeepsItsActivation(torch.nn.Module):
    """Keeps a function as a plain attribute, as nn.TransformerEncoderLayer
    keeps ``activation``."""

    def __init__(self):
        super().__init__()
        self.act = torch.nn.functional.relu

    def forward(self, x):
        return self.act(x)


def test_a_function_a_module_keeps_or_a_forward_set_on_it_later_is_seen():
    net = _KeepsItsActivation()
    identity = torch.nn.Identity()
    f = t2j_ad.jaxify(lambda x: (net(x) ** 2).sum())
    g = t2j_ad.jaxify(lambda x: (identity(x) ** 2).sum())
    x = jnp.arange(1.0, 9.0)
    for h in (f, g):
        assert_tree_allclose(jax.grad(h)(x), 2 * x)
    net.act = lambda t: torch.nn.functional.dropout(t, 0.5)  # a later cell
    identity.forward = lambda t: torch.nn.functional.dropout(t, 0.5)
    _against_torch_func(f, lambda t: (net(t) ** 2).sum(), x)
    _against_torch_func(g, lambda t: (identity(t) ** 2).sum(), x, seed=1)


class _Lazy(dict):
    """A dict whose lookups raise until it is ready."""

    def __getitem__(self, key):
        raise RuntimeError("lazy object not ready")


def test_names_that_cannot_be_read_back_are_not_looked_at():
    table = _Lazy(model=torch.nn.Identity())
    proxy = weakref.proxy(torch.nn.Identity())  # dead already

    def f(x):
        return x * 2 if table or proxy is None else x

    for _ in range(2):
        assert_tree_allclose(t2j_ad.jaxify(f)(jnp.ones(3)), 2 * jnp.ones(3))
    seen = BindingsSeen(f)
    # The global table, a forward set later on its module, f's own code: not
    # table["model"], which cannot be read back, nor the dead proxy.
    assert seen.hold() and len(seen) == 3


def test_a_tensor_the_function_only_reads_bound_afresh_resolves_nothing(resolved):
    # Only the tensors it updates count: a training loop that binds new
    # parameters every step re-resolved (and traced) on every call.
    norm = torch.nn.BatchNorm1d(3, dtype=torch.float64).to(TORCH_DEVICE)
    scale = {"w": torch.ones(3, dtype=torch.float64, device=TORCH_DEVICE)}
    f = t2j_ad.jaxify(lambda x: (norm(x) * scale["w"]).sum())
    x = jnp.arange(12.0).reshape(4, 3)
    for k in range(3):
        scale["w"] = torch.full((3,), float(k), dtype=torch.float64, device=TORCH_DEVICE)
        jax.grad(f)(x)
    assert len(resolved) == 1
    assert int(norm.num_batches_tracked) == 3


def test_a_callable_bound_afresh_every_step_under_jit_keeps_few_effects(rebound):
    # Each new partial is another object: its effects are looked up again,
    # and the ones kept per function stay few (they had grown by one a step).
    import functools

    from t2j_ad import replayed_calls

    global noise
    noise = functools.partial(torch.mul, other=2.0)
    f = t2j_ad.jaxify(lambda x: (noise(x) ** 2).sum())
    step = jax.jit(jax.value_and_grad(f))
    x = jnp.arange(1.0, 4.0)
    for k in range(40):
        noise = functools.partial(torch.mul, other=2.0)
        value, grad = step(x)
        assert_tree_allclose((value, grad), ((4 * x**2).sum(), 8 * x))
    bases = [entry.base for entry in f._cache.values()]
    assert all(len(b.__dict__.get("effects_by_modes", {})) <= replayed_calls._EFFECTS_KEPT for b in bases)


class _Base(torch.nn.Module):
    def forward(self, x):
        return (noise(x) ** 2).sum()


class _Inherits(_Base):
    """Its forward is its base class's."""


def test_a_helper_an_inherited_forward_calls_or_the_base_forward_patched_is_seen(rebound):
    global noise
    net = _Inherits()
    f = t2j_ad.jaxify(lambda x: net(x))
    x = jnp.arange(1.0, 9.0)
    assert_tree_allclose(jax.grad(f)(x), 2 * x)

    def noise(x):  # noqa: F811 - the helper's cell run again, edited
        return torch.nn.functional.dropout(x, 0.5)

    _against_torch_func(f, lambda t: net(t), x)
    forward = _Base.forward
    _Base.forward = lambda self, x: (torch.nn.functional.dropout(x, 0.2) ** 2).sum()
    try:
        _against_torch_func(f, lambda t: net(t), x, seed=1)
    finally:
        _Base.forward = forward


class _Loss:
    """A callable object of the user's, as a loss class is one."""

    def __call__(self, x):
        return (noise(x) ** 2).sum()


def test_a_callable_object_or_a_partial_as_the_function_follows_its_names(rebound):
    import functools

    global noise
    loss = _Loss()
    scaled = functools.partial(lambda x, k: (noise(x) ** 2).sum() * k, k=1.0)
    f, g = t2j_ad.jaxify(loss), t2j_ad.jaxify(scaled)
    x = jnp.arange(1.0, 9.0)
    for h in (f, g):
        assert_tree_allclose(jax.grad(h)(x), 2 * x)

    def noise(x):  # noqa: F811 - the helper's cell run again, edited
        return torch.nn.functional.dropout(x, 0.5)

    _against_torch_func(f, loss, x)
    _against_torch_func(g, scaled, x, seed=1)


def test_a_name_the_function_binds_afresh_itself_is_not_remembered(resolved):
    state = {"on_done": lambda: None}

    def f(x):
        state["on_done"] = lambda: None  # a per-call callback
        return x * 2

    g = t2j_ad.jaxify(f)
    for _ in range(4):
        assert_tree_allclose(g(jnp.ones(3)), 2 * jnp.ones(3))
    assert len(resolved) == 1


class _RebindsItsActivation(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.act = torch.tanh

    def forward(self, x):
        self.act = lambda t: torch.tanh(t)  # a fresh callable every call
        return (self.act(self.lin(x)) ** 2).sum()


def test_a_callable_a_modules_forward_binds_afresh_each_call_resolves_once(resolved):
    # The runs that infer output shapes put the module's attributes back, so
    # the name looked rebound by the user after each call: every call
    # resolved its signature again (60-140x slower), and under jax.jit every
    # derivative call ran its effects again.
    net = _RebindsItsActivation().to(TORCH_DEVICE).double()
    f = t2j_ad.jaxify(lambda x: net(x))
    step = jax.jit(jax.value_and_grad(f))
    x = jnp.arange(1.0, 4.0)
    grad, value = torch.func.grad_and_value(lambda t: net(t))(to_torch(x))
    for _ in range(4):
        assert_tree_allclose(f(x), to_numpy(value))
        assert_tree_allclose(step(x), (to_numpy(value), to_numpy(grad)))
    assert len(resolved) == 1
    bases = [entry.base for entry in f._cache.values()]
    assert all(len(b.__dict__.get("effects_by_modes", {})) <= 1 for b in bases)


def _identity(t):
    return t


def _dropout(t):
    return torch.nn.functional.dropout(t, 0.5, training=True)


class _ChoosesItsActivation(torch.nn.Module):
    """Binds its activation by a flag on every call, the same function or a
    fresh lambda."""

    def __init__(self, fresh):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 2.0, 8))
        self.noisy = False
        self.fresh = fresh
        self.act = _identity

    def forward(self, x):
        if self.fresh:
            self.act = (lambda t: _dropout(t)) if self.noisy else (lambda t: t)
        else:
            self.act = _dropout if self.noisy else _identity
        return (self.act(self.w * x) ** 2).sum()


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("noisy_from", [1, 5])
def test_a_name_a_forward_binds_by_a_flag_is_seen_when_the_flag_changes(fresh, noisy_from):
    """NOTE [a name the function rebinds, watched by its code]: the name was
    forgotten once a call had rebound it, so after the flag switched dropout
    on, value and gradient came from different masks, for good."""
    net = _ChoosesItsActivation(fresh).to(TORCH_DEVICE).double()
    f = t2j_ad.jaxify(lambda x: net(x))
    x = jnp.linspace(-1.0, 1.0, 8)
    # A graph keeps the branch its trace took on the plain attribute ``noisy``
    # (read once per trace); a fresh lambda bound on every call is a forward
    # changing Python state, which runs eagerly and so sees the flag.
    traced_flag = READ_ONCE_PER_TRACE and not fresh
    twin = _ChoosesItsActivation(fresh).to(TORCH_DEVICE).double()
    for step in range(noisy_from + 3):
        if step == noisy_from:
            net.noisy = True
        twin.noisy = net.noisy and not traced_flag
        try:
            _against_torch_func(f, lambda t: twin(t), x, seed=step)
        except AssertionError:
            raise
        except Exception as err:  # the call that finds the switch may be refused, naming why
            assert step == noisy_from and "or its own run bound one" in str(err), err
