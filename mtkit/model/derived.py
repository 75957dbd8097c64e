"""Weights that decoding derives from a model's parameters (joined, packed), kept while the parameters last.

A model being trained is also decoded (validation between updates), so a derived copy is checked against its
sources at each use and made again once one of them changed: moved, replaced, cast or changed in place. A fused
optimizer (``torch.optim.Adam(fused=True)``, as training steps) changes parameters in place without counting the
change, so the modules that hold derived copies also drop them whenever their mode is set (``train()``, ``eval()``),
which a training loop does between its updates and its validations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from torch import Tensor

Value = TypeVar("Value")


def stamp(t: Tensor) -> tuple[int, int]:
    """Where a tensor's values live and how often they were changed in place: it differs once its values may."""
    return t.data_ptr(), 0 if t.is_inference() else t._version


class Derived(Generic[Value]):
    """One value made from some tensors, made again only when one of them changes."""

    def __init__(self) -> None:
        # The sources are held so that their memory goes to no other tensor while a stamp refers to it.
        self._held: tuple[list[Tensor], list[tuple[int, int]], Value] | None = None

    def get(self, sources: list[Tensor], make: Callable[[], Value]) -> Value:
        """The value ``make()`` returned for these sources, made now if they are new or changed."""
        stamps = [stamp(t) for t in sources]
        if self._held is None or self._held[1] != stamps:
            self._held = (sources, stamps, make())
        return self._held[2]

    def clear(self) -> None:
        """Forget the value: the next ``get`` makes it again."""
        self._held = None
