"""The package version (a module of its own, so that low layers can read it without importing
the package root, which re-exports the client)."""

__version__ = "0.1.0"
