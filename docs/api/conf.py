"""Sphinx configuration of the API reference; built by `make docs` (warnings are errors)."""

import inspect

project = "mnemojax"
copyright = "the mnemojax authors"

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]

# Google-style docstrings only (the house style).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# `Attributes:` sections become fields of their class, so they never duplicate the
# attributes autodoc documents itself.
napoleon_use_ivar = True

autodoc_member_order = "bysource"
autodoc_default_options = {"show-inheritance": True}
# `name` in a docstring links to the object where one is documented here.
default_role = "py:obj"

html_theme = "alabaster"
html_static_path: list[str] = []


def _skip_builtin_defaults(app, what, name, obj, skip, options):
    """Skips dataclass fields whose default is a builtin function (``clock=time.monotonic``):
    autodoc would document them as methods, with the builtin's docstring."""
    del app, name, options
    if what == "class" and inspect.isbuiltin(obj):
        return True
    return skip


def setup(app):
    app.connect("autodoc-skip-member", _skip_builtin_defaults)
