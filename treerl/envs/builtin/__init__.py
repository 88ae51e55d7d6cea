"""Built-in environments."""
