"""The source torch.fx files for each generated ``forward``, dropped with it.

Every ``GraphModule.recompile`` files its source (and a copy of its globals)
in torch.fx's loader and in ``linecache`` and never removes them: a few
kilobytes per graph, which would grow without bound as fresh jaxified
functions come and go (benchmarks/bench_registry_memory.py --compile graph).
Only traceback source lines of a dead graph are lost.
"""

from __future__ import annotations

import linecache
import weakref
from collections.abc import Sequence

import torch


def source_key(graph: torch.fx.GraphModule) -> str:
    """The name under which torch.fx filed the source of ``graph.forward``."""
    return type(graph).forward.__code__.co_filename


def forget_sources(keys: Sequence[str]) -> None:
    """Drop the generated sources filed under ``keys``."""
    loader = getattr(torch.fx.graph_module, "_loader", None)  # private; absent: nothing to drop
    for key in keys:
        if loader is not None:
            loader.eval_cache.pop(key, None)
        linecache.cache.pop(key, None)


def recompile(graph: torch.fx.GraphModule) -> None:
    """``graph.recompile()``, its old source forgotten now and its new one
    when it dies (``forget_sources``)."""
    old = source_key(graph)
    graph.recompile()
    forget_sources([old])
    forget_with(graph)


def forget_with(graph: torch.fx.GraphModule) -> None:
    """Drop ``graph``'s current source when it dies."""
    weakref.finalize(graph, forget_sources, [source_key(graph)])
