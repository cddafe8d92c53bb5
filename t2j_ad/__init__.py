"""t2j_ad: call PyTorch from JAX, under jit and every JAX transform."""

from .api import JaxifiedFunction as JaxifiedFunction
from .api import clear_caches as clear_caches
from .api import jaxify as jaxify
from .module import jaxify_module as jaxify_module
from .convert import ArrayConversionError as ArrayConversionError
from .convert import tree_j2t as tree_j2t
from .convert import tree_t2j as tree_t2j
from .rules.fallbacks import FallbackWarning as FallbackWarning
from .runtime import InputMutationError as InputMutationError
from .runtime import TorchCallError as TorchCallError
from .runtime import set_torch_threads as set_torch_threads

__all__ = [
    "ArrayConversionError",
    "FallbackWarning",
    "InputMutationError",
    "JaxifiedFunction",
    "TorchCallError",
    "clear_caches",
    "jaxify",
    "jaxify_module",
    "set_torch_threads",
    "tree_j2t",
    "tree_t2j",
]
__version__ = "0.1.0"
