"""The one ``__version__`` (pyproject.toml reads it here), apart: any part names it without the package root."""
__version__ = "0.1.0"
