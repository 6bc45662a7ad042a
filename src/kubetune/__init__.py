"""kubetune: distributed fine-tuning of transformer models from one YAML job spec."""

from kubetune.version import __version__

__all__ = ["Client", "__version__"]


def __getattr__(name: str):
    # Lazy: `import kubetune` stays cheap; `kubetune.Client` imports the client on first use.
    if name == "Client":
        from kubetune.client import Client

        return Client
    raise AttributeError(name)
