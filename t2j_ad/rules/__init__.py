"""JAX rules of the torch_call primitive, one file per rule (registered in primitive.py)."""
