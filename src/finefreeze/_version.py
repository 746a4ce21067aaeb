"""The one place the version is written."""

__version__ = "0.1.0"
