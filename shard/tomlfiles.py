"""TOML read with one-line errors: the files a user gives shard (a config, a mesh preset, a hardware
table) and the config text saved with a run."""

import tomllib
from pathlib import Path

from shard.errors import ShardError


def read_text(path, name: str) -> str:
    """A text file's contents (`path`: a str, a Path or a package resource); `name` says what the file
    is in the errors, as in "config file run.toml"."""
    if isinstance(path, str | Path):
        path = Path(path)
        if path.is_dir():
            raise ShardError(f"{name} is a directory; give a TOML file")
        if path.exists() and not path.is_file():  # a FIFO would block the read
            raise ShardError(f"{name} is not a regular file; give a TOML file")
    try:
        return path.read_text().removeprefix("\ufeff")  # a byte-order mark, as Windows editors write
    except FileNotFoundError:
        raise ShardError(f"{name} not found") from None
    except UnicodeDecodeError:
        raise ShardError(f"{name} is not a text (TOML) file") from None
    except OSError as e:
        raise ShardError(f"{name} cannot be read: {e.strerror or e}") from None


def parse(text: str, name: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ShardError(f"{name} is not valid TOML: {e}") from None


def read(path, name: str) -> dict:
    return parse(read_text(path, name), name)
