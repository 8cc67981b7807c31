"""Modules the agent's start imports without using them, loaded only when used: every
module imported before the agent serves costs boot time (a few ms each under TCG)."""
from __future__ import annotations

import importlib
import sys
import types


class Deferred(types.ModuleType):
    """Stands in sys.modules for a module that is only imported if something reads an
    attribute of it; `import name` of it is free until then."""

    def __getattr__(self, attr: str) -> object:
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attr)


def defer(*names: str) -> None:
    """Defer each of `names` not imported yet."""
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = Deferred(name)
