"""The one ``__version__`` (pyproject.toml reads it from here), in a module of its own: any part names it
without the package root."""
__version__ = "0.1.0"
