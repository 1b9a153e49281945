"""The checks a value read from a user's file passes (a config, a hardware table, a Hugging Face
config.json), shared by the config, shard.hardware and shard.run.hf_config. It imports nothing of
shard's, so that shard.hardware, beside the config, need not import the config modules that ask it
about the machine (an import loop)."""

import math


def is_positive_number(value) -> bool:
    """A finite number above 0, and not a bool: what a size or rate read from any file must be."""
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 < value < math.inf
