"""The exception the public functions raise for refused arguments.

Every requirement a call breaks (shape, dtype, device, option, index value) is listed in one message, raised
before anything is written.  The ops themselves (``torch.ops.flash_ext.*``) raise ``ValueError``: the
dispatcher turns the C++ checks' ``c10::ValueError`` into it.  flash_attn 2.8 raises ``RuntimeError`` from
its C++ checks (``TORCH_CHECK``), so code written for it that falls back on ``except RuntimeError`` would let
a ``ValueError`` through; the public functions therefore raise ``ArgumentError``, which is both."""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

__all__ = ["ArgumentError", "raises_argument_error"]


class ArgumentError(ValueError, RuntimeError):
    """Arguments a flash_ext function refuses: a ``ValueError`` (a value broke a rule), and a ``RuntimeError``
    as flash_attn 2.8's checks raise."""


F = TypeVar("F", bound=Callable)


def raises_argument_error(fn: F) -> F:
    """``fn`` with its ``ValueError`` (its own checks' and the ops') raised as ``ArgumentError``, message and
    traceback kept (the handler costs nothing until something is raised).  torch.compile traces through it
    (fullgraph), but an op's refusal raised while a compiled graph runs arrives as the op's ``ValueError``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ArgumentError:
            raise
        except ValueError as e:
            raise ArgumentError(*e.args).with_traceback(e.__traceback__) from None

    return wrapper  # type: ignore[return-value]
