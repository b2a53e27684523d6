"""The package version, kept in the bottom layer so that any module may record it."""
__version__ = "0.2.0"
