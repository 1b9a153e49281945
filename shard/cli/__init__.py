"""The `shard` command: one module per command; each parses, calls the library and prints."""
