"""JAX rules of the torch_call primitive, one file per rule (registered in registration.py),
and the PyTorch-side fallbacks (fallbacks.py)."""
