"""Compatibility layers; each is inert until you call its ``install()``.

- :mod:`machinlike.compat.machin`: make ``import machin.parallel...`` resolve to machinlike.
"""

__all__: list = []
