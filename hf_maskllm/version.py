"""The package's version, in a module of its own at the bottom of the layers: any module may read it."""

__all__ = ["__version__"]

__version__ = "0.1.0"
