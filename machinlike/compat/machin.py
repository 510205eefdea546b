"""Make machin's own package run on machinlike: ``machin.parallel.X`` resolves to ``machinlike.X``.

A machin user cannot edit the imports inside machin's installed package (``machin.frame``
imports ``machin.parallel.server``, ``machin.parallel.distributed``...). One call, made
before ``import machin``, routes them here::

    import machinlike.compat.machin
    machinlike.compat.machin.install()
    from machin.frame.algorithms import A3C      # its machin.parallel is machinlike now

How. :func:`install` puts a finder first on ``sys.meta_path``. When ``machin.parallel``
or ``machin.parallel.<path>`` is imported, it imports ``machinlike`` or
``machinlike.<path>`` and hands out *that module object* under the machin name, so
``machin.parallel.server.PushPullGradServer is machinlike.server.PushPullGradServer``.
The module's own ``__spec__`` (and so its name and file) is kept. A machin path that has
no machinlike module of the same name (``machin.parallel.server.param_server``,
``machin.parallel.util``...) fails with :class:`ModuleNotFoundError`; machin's own
package imports none of them.

Importing this module changes nothing; :func:`install` is explicit, idempotent, and
undone by :func:`uninstall`. Only ``machin.parallel`` is redirected: the rest of machin
(``machin.frame``, ``machin.utils``...) is machin's own code, with its own dependencies.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from typing import Optional, Sequence

__all__ = ["install", "uninstall", "is_installed"]

_MACHIN = "machin.parallel"
_OURS = "machinlike"
_lock = threading.Lock()


class _AliasLoader(importlib.abc.Loader):
    """Hands out an already imported machinlike module under a machin name."""

    def __init__(self, module: types.ModuleType) -> None:
        self._module = module
        self._spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self._module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system has just set module.__spec__ to the machin-named spec;
        # give the machinlike module its own back (its name, file and loader stay).
        module.__spec__ = self._spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[types.ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != _MACHIN and not fullname.startswith(_MACHIN + "."):
            return None
        ours = _OURS + fullname[len(_MACHIN):]
        try:
            module = importlib.import_module(ours)
        except ModuleNotFoundError as exc:
            if exc.name != ours:
                raise  # machinlike itself failed to import something: not ours to hide
            raise ModuleNotFoundError(
                f"{fullname!r} has no machinlike counterpart ({ours!r} does not exist); see "
                f"'Coming from machin' in machinlike's documentation", name=fullname) from None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(module),
                                               is_package=hasattr(module, "__path__"))


_finder: Optional[_Finder] = None


def install() -> None:
    """Route ``machin.parallel`` and its submodules to machinlike (call before ``import machin``).

    Safe to call twice.

    Raises:
        RuntimeError: machin's own ``machin.parallel`` was imported already in this
            process: its classes are in use, and replacing the module now would mix
            the two. Call :func:`install` first thing, before anything imports machin.
    """
    global _finder
    with _lock:
        if _finder is not None:
            return
        loaded = sys.modules.get(_MACHIN)
        if loaded is not None and not loaded.__name__.startswith(_OURS):
            raise RuntimeError(
                "machin.parallel is already imported (machin's own): call "
                "machinlike.compat.machin.install() before anything imports machin")
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Undo :func:`install`: remove the finder and forget the ``machin.parallel*`` names.

    Modules already holding references to machinlike's classes keep them. Safe to call
    when not installed.
    """
    global _finder
    with _lock:
        if _finder is None:
            return
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass
        _finder = None
        for name in [n for n in sys.modules if n == _MACHIN or n.startswith(_MACHIN + ".")]:
            del sys.modules[name]


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _finder is not None
