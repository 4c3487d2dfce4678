"""Code written for flash_attn 2.8, run on flash_ext unchanged: ``flash_ext.install_as_flash_attn()`` makes
``import flash_attn`` (and ``flash_attn.flash_attn_interface``, ``flash_attn.bert_padding``) resolve to flash_ext
in this process, for libraries that import flash_attn themselves (ring-flash-attention and the context-parallel
code built on it, training scripts).

Opt-in and explicit, never a side effect of ``import flash_ext``: it changes what a module name means for the
whole process.  Refused when a real flash_attn is already imported (modules holding its functions would keep
them: two implementations in one process).  The alias's ``__version__`` is the flash_attn API level flash_ext
implements ("2.8.3"); ``__flash_ext__`` marks it as the alias.  Code that asks the package metadata
(``importlib.metadata.version("flash_attn")``, as transformers does before choosing flash_attention_2) still
finds no flash_attn distribution: for transformers use ``flash_ext.integrations.transformers``.  Only the three
modules exist under the name: with a real flash_attn installed, its other modules (``flash_attn.layers``,
``flash_attn.ops``, ``flash_attn.modules``, ...) are hidden while the alias is in place.  The alias lives in
``sys.modules`` of this process: a process started with ``spawn`` calls it again.
"""
from __future__ import annotations

import importlib.machinery
import sys
import types

from .errors import ArgumentError

__all__ = ["install_as_flash_attn", "FLASH_ATTN_API_VERSION"]

FLASH_ATTN_API_VERSION = "2.8.3"
"""The flash_attn release whose Python API (functions, arguments, returns) the alias stands for."""


def install_as_flash_attn() -> types.ModuleType:
    """Registers flash_ext under the module names ``flash_attn``, ``flash_attn.flash_attn_interface`` and
    ``flash_attn.bert_padding`` in ``sys.modules``; returns the ``flash_attn`` alias.  Calling it again is
    harmless.  ``ArgumentError`` when a module named ``flash_attn`` that is not the alias is already imported."""
    from . import bert_padding, flash_attn_interface

    present = sys.modules.get("flash_attn")
    if present is not None and getattr(present, "__flash_ext__", False):
        return present
    real = sorted(name for name in sys.modules if name == "flash_attn" or name.startswith("flash_attn."))
    if real:
        module = sys.modules[real[0]]
        raise ArgumentError(
            f"flash_ext.install_as_flash_attn: sys.modules['{real[0]}']: got {getattr(module, '__file__', module)!r}; "
            "must not be imported yet (the modules that imported it keep its functions: two implementations in one "
            "process); call install_as_flash_attn() before anything imports flash_attn")
    alias = types.ModuleType("flash_attn", doc=f"flash_ext, under flash_attn {FLASH_ATTN_API_VERSION}'s module name "
                                               "(flash_ext.install_as_flash_attn).")
    # A module spec and a file, as an imported package has: importlib.util.find_spec("flash_attn"), the check
    # transformers, accelerate and peft run on import, raised ValueError ("__spec__ is None") without one.
    alias.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, origin=__file__, is_package=True)
    alias.__file__ = __file__
    for name in flash_attn_interface.__all__:
        if not name.startswith("_"):
            setattr(alias, name, getattr(flash_attn_interface, name))
    alias.__version__ = FLASH_ATTN_API_VERSION
    alias.__flash_ext__ = True
    alias.__path__ = []  # a package: its submodules are the entries below
    alias.flash_attn_interface = flash_attn_interface
    alias.bert_padding = bert_padding
    sys.modules["flash_attn.flash_attn_interface"] = flash_attn_interface
    sys.modules["flash_attn.bert_padding"] = bert_padding
    sys.modules["flash_attn"] = alias
    return alias
