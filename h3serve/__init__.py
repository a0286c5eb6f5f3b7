"""h3serve: production serving for MiniMax H3 and its 4-step student FastH3."""

__version__ = "0.1.0"
