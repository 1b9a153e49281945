"""Tokens for training and evaluation: tokenizers, sources, windows and the global batch."""
