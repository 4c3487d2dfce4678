"""The exception the public functions raise for refused arguments.

Every requirement a call breaks (shape, dtype, device, option, index value) is listed in one message, raised
before anything is written.  The ops themselves (``torch.ops.flash_ext.*``) raise ``ValueError``: the
dispatcher turns the C++ checks' ``c10::ValueError`` into it.  flash_attn 2.8 raises ``RuntimeError`` from
its C++ checks (``TORCH_CHECK``), so code written for it that falls back on ``except RuntimeError`` would let
a ``ValueError`` through; the public functions therefore raise ``ArgumentError``, which is both."""
from __future__ import annotations

import functools
import inspect
from typing import Callable, List, TypeVar

import torch

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
        except RuntimeError as e:  # NotImplementedError included: what torch raises for tensors without strides
            layouts = _layout_errors(fn, args, kwargs)
            if not layouts:
                raise
            raise ArgumentError(f"flash_ext.{fn.__name__}: {len(layouts)} invalid argument"
                                f"{'s' if len(layouts) > 1 else ''}:" +
                                "".join(f"\n  - {x}" for x in layouts)) from e

    # inspect.getfullargspec (which code written for flash_attn uses to read its functions' parameters and
    # defaults) does not follow __wrapped__, but reads __signature__.
    wrapper.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def _layout_errors(fn: Callable, args: tuple, kwargs: dict) -> List[str]:
    """The tensor arguments that are not dense strided tensors (sparse, nested, mkldnn): torch's own error
    about them, raised somewhere inside (a dispatcher key, a memory format, missing strides), names no
    argument.  Looked for only after a failure, so a call pays nothing for it."""
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return []
    found = []
    for name, value in bound.items():
        if isinstance(value, torch.Tensor) and (value.is_nested or value.layout != torch.strided):
            kind = "nested" if value.is_nested else str(value.layout).removeprefix("torch.").lstrip("_")
            found.append(f"{name}: got a {kind} tensor; must be a dense (strided) tensor")
    return found
