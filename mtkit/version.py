"""mtkit's version: a leaf every module may import (the package's face imports the whole API lazily)."""

__version__ = "0.1.0"
