"""What `help()` shows for each public name of `tokenmill` is that name's own description.

`inspect.getdoc` (which `help()`, pydoc and IDEs use) falls back to a base class's docstring when a
class has none, so a class built from mixins without a docstring of its own is described by
whichever mixin comes first in its MRO.
"""

from __future__ import annotations

import inspect

import tokenmill


def test_every_public_class_has_a_docstring_of_its_own():
    classes = {name: getattr(tokenmill, name) for name in tokenmill.__all__}
    inherited = sorted(name for name, cls in classes.items()
                       if inspect.isclass(cls) and not cls.__dict__.get("__doc__"))
    assert not inherited, f"help() describes {inherited} with a base class's docstring"
