"""mtkit: a readable, fast machine-translation toolkit (Transformer NMT from tokenizer to sacreBLEU).

The Python API (``mtkit.load``, ``mtkit.train``, ``mtkit.evaluate``, ``mtkit.prepare``,
``mtkit.read_config``; see mtkit/api.py) is imported on first use, so ``mtkit --help`` stays instant.
"""

from mtkit.errors import MtkitError
from mtkit.version import __version__ as __version__

__all__ = ["MtkitError", "evaluate", "load", "prepare", "read_config", "train"]


def __getattr__(name: str):
    if name in __all__:
        from mtkit import api

        return getattr(api, name)
    raise AttributeError(f"module 'mtkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The API functions too, which ``__getattr__`` imports on first use: ``dir(mtkit)`` and completion show them."""
    return sorted({*globals(), *__all__})
