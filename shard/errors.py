"""The one exception users can cause: the CLI turns it into a one-line message and exit code 2."""


class ShardError(Exception):
    """A mistake in the user's input (mesh, config, data, rules), reported in one line."""
