"""kubetune: distributed fine-tuning of transformer models from one YAML job spec."""

__version__ = "0.1.0"
