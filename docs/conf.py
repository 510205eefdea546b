"""Sphinx configuration of the machinlike documentation.

Build:  python -m sphinx -W -b html docs docs/_build/html
(``tests/test_docs.py`` runs exactly this, so a broken reference fails the test suite.)
"""

from __future__ import annotations

import os
import sys

# The package is documented from this checkout, installed or not.
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

project = "machinlike"
author = "the machinlike authors"
copyright = "the machinlike authors"
release = version = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "tutorials/code"]

root_doc = "index"
# furo: the layout follows the screen (the sidebars fold away on a phone), and wide
# tables and code scroll inside their own box instead of the page.
html_theme = "furo"
html_title = "machinlike"
html_static_path = ["_static"]
html_css_files = ["narrow.css"]

# -- autodoc / napoleon --------------------------------------------------------------
autodoc_default_options = {"show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes as fields of their class, not as separate objects (a class that also
# documents the same name elsewhere would otherwise clash).
napoleon_use_ivar = True

# Every reference to a machinlike object must resolve: a broken one fails the -W build.
# Without intersphinx (the build runs offline), references to torch, the standard
# library and typing cannot resolve and are ignored.
nitpicky = True
# A private machinlike name (``machinlike.event._CompositeEvent`` in an annotation), or a
# name in a private module, is not documented either; it renders as plain text.
nitpick_ignore_regex = [(r"py:.*", r"(?!machinlike\b).*"), (r"py:.*", r"machinlike(\.\w+)*\._\w+(\.\w+)*")]


def _public_target(app, env, node, contnode):
    """Resolve a reference to where the object is documented.

    autodoc spells annotation types by their defining module
    (``machinlike.distributed._world.world.World``) and docstrings may use a re-exported path
    (``machinlike.World``); the reference documents each object once, at its public
    path (``machinlike.distributed.World``). Private path parts are dropped and the
    longest suffix that names exactly one documented machinlike object wins.
    """
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not target.startswith("machinlike."):
        return None
    public = [p for p in target.split(".")[:-1] if not p.startswith("_")] + target.split(".")[-1:]
    domain = env.get_domain("py")
    names = [name for name in domain.objects if name.startswith("machinlike.")]
    for start in range(1, len(public)):
        suffix = "." + ".".join(public[start:])
        found = [name for name in names if name.endswith(suffix)]
        if len(found) == 1:
            return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], found[0], node, contnode)
        if found:
            return None  # ambiguous: leave it to the nitpicky warning
    return None


def _is_public_class(cls) -> bool:
    """Whether the reference documents ``cls``: machinlike classes only when a public
    module exports them (``machinlike.pool._api.PoolBase`` is an implementation detail)."""
    module = getattr(cls, "__module__", "")
    if not module.startswith("machinlike"):
        return True
    if cls.__name__.startswith("_"):
        return False
    public_module = ".".join(p for p in module.split(".") if not p.startswith("_"))
    return cls.__name__ in getattr(sys.modules.get(public_module), "__all__", ())


def _public_bases(app, name, obj, options, bases):
    """Show documented base classes only: another machinlike base is replaced by its own
    bases, recursively."""
    public = []
    pending = list(bases)
    while pending:
        base = pending.pop(0)
        if not _is_public_class(base):
            pending[0:0] = [b for b in base.__bases__ if b is not object]
        elif base not in public:
            public.append(base)
    bases[:] = public or [object]


#: Classes that programs get from a factory, never construct: their constructor's
#: arguments are internal, so the reference shows no signature for them.
FACTORY_MADE = {
    "machinlike.distributed.RpcGroup": "World.create_rpc_group",
    "machinlike.distributed.CollectiveGroup": "World.create_collective_group",
    "machinlike.distributed.RpcFuture": "RpcGroup.registered_async and rpc_async",
    "machinlike.distributed.Membership": "World.membership",
    "machinlike.distributed.LaunchResult": "launch",
    "machinlike.server.ServerHandles": "grad_server_helper and model_server_helper",
    "machinlike.pool.AsyncResult": "Pool.apply_async",
    "machinlike.pool.MapResult": "Pool.map_async and starmap_async",
    "machinlike.pool.IMapIterator": "Pool.imap",
    "machinlike.pool.IMapUnorderedIterator": "Pool.imap_unordered",
}


def _hide_internal_signature(app, what, name, obj, options, signature, return_annotation):
    if what == "class" and name in FACTORY_MADE:
        return "", return_annotation
    return None


def setup(app):
    app.connect("autodoc-process-signature", _hide_internal_signature)
    app.connect("missing-reference", _public_target)
    app.connect("autodoc-process-bases", _public_bases)
