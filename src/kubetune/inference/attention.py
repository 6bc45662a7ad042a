"""The attention-implementation plumbing that training and inference share: which attention function
transformers runs for a name in a given module (``model_attention``), and the attention implementations that
kubetune registers as a wrapper over another one (``wrap``, ``base_attention``).

Training's packed attention (``tasks.attention``) registers ``kubetune_packed`` over ``sdpa`` or ``eager``
and runs the wrapped one for everything that is not a packed row; the generation engine's packed step
(``inference.step``) runs, for a model loaded with such a wrapper, the attention underneath. Both reach the
wrapper table only through the names here: neither knows the other's internals.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

# Attention implementations registered as a wrapper over another one: name -> the one it runs for everything
# but what it was written for (``wrap``). Written when a wrapper is registered, read by ``base_attention``.
WRAPPED: dict[str, str] = {}


def wrap(name: str, base: str) -> None:
    """Record that the attention implementation ``name`` wraps ``base``: code that runs a model's own attention
    (the generation engine's packed step) runs ``base`` for a model whose config names ``name``."""
    WRAPPED[name] = base


def base_attention(name: str) -> str:
    """The attention implementation underneath ``name`` (``name`` itself where it wraps none)."""
    return WRAPPED.get(name, name)


def model_attention(module: torch.nn.Module, name: str) -> Callable[..., Any]:
    """The attention function transformers runs for ``name`` in ``module``. ``eager`` is not in transformers'
    registry: each model file defines its own ``eager_attention_forward`` beside the attention module, which
    is what transformers itself calls for it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is not None:
            return eager
        name = "sdpa"  # a model file without its own eager function: the same result through SDPA
    return ALL_ATTENTION_FUNCTIONS[name]
