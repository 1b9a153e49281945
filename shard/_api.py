"""How a package lists its public API (`__all__`): names loaded from their modules on first use, and
submodules that are API whole, so importing the package starts no JAX. What is not listed may move."""

import importlib
import sys
from collections.abc import Callable


def lazy_api(package: str, names: dict[str, str], modules: tuple[str, ...] = ()) -> tuple[Callable, Callable, list]:
    """(__getattr__, __dir__, __all__) for `package`: each of `names` from the module it maps to, each of
    `modules` the submodule itself."""

    def __getattr__(name: str):
        if name in modules:
            return importlib.import_module(f"{package}.{name}")
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        setattr(sys.modules[package], name, value)  # the next lookup finds it directly
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names) | set(modules))

    return __getattr__, __dir__, [*names, *modules]
