"""selfspec: faster generation from one model, by drafting with its own heads or shallow layers."""

__version__ = "0.1.0"
