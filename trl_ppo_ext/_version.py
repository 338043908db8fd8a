"""The package version, in one place (the package and the run manifest read it)."""

__version__ = "0.1.0"
