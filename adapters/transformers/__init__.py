"""transformers adapter (in progress)."""
