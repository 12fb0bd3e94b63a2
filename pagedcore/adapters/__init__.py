"""Framework adapters for pagedcore."""
