"""The one exception users can cause: the CLI turns it into a one-line message and exit code 2."""


class ShardError(Exception):
    """A mistake in the user's input (mesh, config, data, rules), reported in one line."""


class DivergenceError(ShardError):
    """The loss or gradient norm went non-finite or spiked; the run stops before saving anything."""
