"""The pickles of the callables gpuq.Executor sends, made once per function while nothing it
names can have changed.

cloudpickle pickles a function of ``__main__`` (or a lambda, a closure) by value: its code, and
the globals, defaults and closure cells it uses, as they are when pickled. Pickling the same
function again is most of a small task's cost. A pickle is reused only while it would come out
the same: the function is the same object with the same code, defaults and attributes, and
every global and closure cell it names holds the same object, each of them one that cannot
change in place (None, numbers, strings, bytes, tuples and frozensets of those, modules,
classes and functions of importable modules, and functions that meet these rules themselves).
A function that names a list, a dict, an array or an instance is pickled anew on every call,
as before. A function of an importable module pickles as its name alone and is always reused.

The worker keeps what it unpickled by the pickle's bytes (gpuq._worker), so a reused pickle is
also not unpickled again.
"""

from __future__ import annotations

import pickle
import sys
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))
_MAX_DEPTH = 4
_MAX_ENTRIES = 256


def _by_reference(obj: Any) -> bool:
    """Whether pickle finds ``obj`` by its module and name (an importable module's function or
    class, not ``__main__``'s): such a pickle is the name alone."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<locals>" in qualname:
        return False
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found is obj


def _code_names(code: types.CodeType, into: set) -> None:
    into.update(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_names(c, into)


class _Snapshot:
    """What a by-value function's pickle depends on, to tell whether it is still the same."""

    __slots__ = ("checks", "functions", "seen")

    def __init__(self) -> None:
        # (container, key or None for a cell, the object it held)
        self.checks: List[Tuple[Any, Any, Any]] = []
        self.functions: List[types.FunctionType] = []  # whose attributes must stay none
        self.seen: set = set()  # ids of the functions looked at (recursion)

    def same(self) -> bool:
        if any(f.__dict__ for f in self.functions):
            return False
        for where, key, held in self.checks:
            if key is None:
                try:
                    now = where.cell_contents
                except ValueError:  # an empty cell
                    now = _EMPTY
            else:
                now = (
                    where.get(key, _EMPTY)
                    if isinstance(where, dict)
                    else getattr(where, key, _EMPTY)
                )
            if now is not held:
                return False
        return True


_EMPTY = object()


def _stable(value: Any, snap: _Snapshot, depth: int) -> bool:
    """Whether ``value`` cannot change under a pickle made now (recording what to re-check)."""
    if isinstance(value, _IMMUTABLE) or isinstance(value, types.ModuleType):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(_stable(v, snap, depth) for v in value)
    if isinstance(value, (type, types.BuiltinFunctionType)):
        return _by_reference(value)
    if isinstance(value, types.FunctionType):
        return _by_reference(value) or _function(value, snap, depth + 1)
    return False


def _function(fn: types.FunctionType, snap: _Snapshot, depth: int) -> bool:
    if id(fn) in snap.seen:
        return True  # being looked at already (a recursive function)
    if depth > _MAX_DEPTH or fn.__dict__:
        return False
    snap.seen.add(id(fn))
    snap.functions.append(fn)
    for attr in ("__code__", "__defaults__", "__kwdefaults__"):
        value = getattr(fn, attr)
        snap.checks.append((fn, attr, value))
        if (
            attr != "__code__"
            and value is not None
            and not _stable(
                tuple(value.values()) if isinstance(value, dict) else value, snap, depth
            )
        ):
            return False
    names: set = set()
    _code_names(fn.__code__, names)
    g = fn.__globals__
    for name in names:
        value = g.get(name, _EMPTY)
        snap.checks.append((g, name, value))
        if value is not _EMPTY and not _stable(value, snap, depth):
            return False
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:
            value = _EMPTY
        snap.checks.append((cell, None, value))
        if value is not _EMPTY and not _stable(value, snap, depth):
            return False
    return True


class FunctionPickles:
    """``get(fn)``: the pickle of ``fn`` (made by ``dumps``), reused while it is still what
    pickling ``fn`` now would give. Not thread-safe on its own: a race makes a pickle twice,
    never a wrong one (each entry is replaced whole)."""

    def __init__(self, dumps: Callable[..., bytes]) -> None:
        self._dumps = dumps
        # id(fn) -> (fn, pickle, snapshot or None when the pickle is the name alone)
        self._cache: Dict[int, Tuple[Any, bytes, Optional[_Snapshot]]] = {}
        self.made = 0  # pickles made (tests)

    def get(self, fn: Any) -> bytes:
        return self.get_stable(fn)[0]

    def get_stable(self, fn: Any) -> Tuple[bytes, bool]:
        """(the pickle of ``fn``, whether it is reused: a function by reference, or one whose
        pickle holds only what cannot change, so no object of the caller's process, such as a
        multiprocessing proxy)."""
        entry = self._cache.get(id(fn))
        if (
            entry is not None
            and entry[0] is fn
            and (entry[2].same() if entry[2] is not None else _by_reference(fn))
        ):
            return entry[1], True  # (by reference: still the object its module names)
        snap: Optional[_Snapshot] = None
        if (
            isinstance(fn, types.MethodType)
            and isinstance(fn.__self__, type)
            and _by_reference(fn.__self__)
        ):
            # A class's method (a classmethod) of an importable class: pickled by reference
            # with the standard pickle, as ProcessPoolExecutor does (cloudpickle would send the
            # function's code by value, which the worker cannot show the source of).
            blob = pickle.dumps(fn, protocol=5)
            self.made += 1
            return blob, True
        if _by_reference(fn) and isinstance(
            fn, (types.FunctionType, type, types.BuiltinFunctionType)
        ):
            cacheable = True
        elif isinstance(fn, types.FunctionType):
            snap = _Snapshot()
            cacheable = _function(fn, snap, 0)
        else:
            cacheable = False  # a bound method, a partial, an object with __call__
        blob = self._dumps(fn, protocol=5)
        self.made += 1
        if cacheable:
            if len(self._cache) >= _MAX_ENTRIES:
                self._cache.clear()
            self._cache[id(fn)] = (fn, blob, snap)
        return blob, cacheable
