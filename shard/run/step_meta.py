"""What a checkpoint step's meta item must hold: each field's type and range, and the step it names
against the folder it stands in. A folder renamed by hand (`6` to `60`) or a meta edited or damaged
would otherwise resume from the wrong step or on other data; the message says which check failed."""

_INT64 = 2**63  # the data stream's sample indices are 64-bit

# field: (required, lowest, highest-or-None; "step" bounds the field by the checkpoint's own step)
_INT_FIELDS = {
    "step": (True, 0, _INT64 - 1),
    "data_position": (True, 0, _INT64 - 1),
    "seed": (True, 0, 2**32 - 1),
    "tokens_seen": (False, 0, _INT64 - 1),
    "held_out_since": (False, 0, "step"),
}


def meta_problem(meta: object, folder_step: int) -> str | None:
    """Why `meta` (a step's meta item, read as JSON) does not describe step `folder_step`, or None."""
    if not isinstance(meta, dict):
        return f"meta is {type(meta).__name__}, not a JSON object"
    for name, (required, low, high) in _INT_FIELDS.items():
        if name not in meta:
            if required:
                return f"meta has no {name}"
            continue
        value = meta[name]
        if not isinstance(value, int) or isinstance(value, bool):
            return f"meta's {name} is {value!r}, not an integer"
        high = folder_step if high == "step" else high
        if value < 0:
            return f"meta has a negative {name} {value}"
        if not low <= value <= high:
            return f"meta's {name} {value} is out of range ({low}..{high})"
    if meta["step"] != folder_step:
        return f"meta says step {meta['step']}, but the folder is named {folder_step} (renamed?)"
    if not isinstance(meta.get("config"), str):
        return "meta holds no config (TOML text)"
    if "fingerprint" in meta and not isinstance(meta["fingerprint"], dict):
        return f"meta's fingerprint is {type(meta['fingerprint']).__name__}, not a JSON object"
    return None
