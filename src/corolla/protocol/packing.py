"""`args_structure` packing compatible with Petals: tensors in `(args, kwargs)` are replaced by markers `b"__T<i>"`
(the same tensor object is sent once) and restored on the other side; unpacking validates untrusted structures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

MARKER_PREFIX = b"__T"
MAX_STRUCTURE_DEPTH = 16
MAX_STRUCTURE_ITEMS = 4096


def _marker(index: int) -> bytes:
    return MARKER_PREFIX + str(index).encode()


def _replace(value: Any, fn: Any) -> Any:
    """Rebuilds a nested tuple/list/dict, applying `fn` to leaves; dict items in sorted key order (as hivemind)."""
    if isinstance(value, tuple):
        return tuple(_replace(v, fn) for v in value)
    if isinstance(value, list):
        return [_replace(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _replace(value[k], fn) for k in sorted(value)}
    return fn(value)


def pack_args_kwargs(*args: Any, **kwargs: Any) -> tuple[list[torch.Tensor], Any]:
    """Returns `(unique_tensors, structure)` where structure is `(args, kwargs)` with tensors replaced by markers."""
    tensors: list[torch.Tensor] = []
    index_of: dict[int, int] = {}  # id(tensor) -> index; identical objects share an index

    def mask(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        index = index_of.get(id(value))
        if index is None:
            index = index_of[id(value)] = len(tensors)
            tensors.append(value)
        return _marker(index)

    return tensors, _replace((args, kwargs), mask)


def _check_structure(value: Any, depth: int, budget: list[int]) -> None:
    if depth > MAX_STRUCTURE_DEPTH:
        raise ValueError(f"args_structure is nested deeper than {MAX_STRUCTURE_DEPTH} levels")
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(f"args_structure has more than {MAX_STRUCTURE_ITEMS} items")
    if isinstance(value, (tuple, list)):
        for item in value:
            _check_structure(item, depth + 1, budget)
    elif isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("args_structure dicts must have str keys")
        for item in value.values():
            _check_structure(item, depth + 1, budget)


def unpack_args_kwargs(tensors: Sequence[torch.Tensor], structure: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inverse of `pack_args_kwargs`; ValueError on a malformed structure or a marker without a tensor."""
    _check_structure(structure, 0, [MAX_STRUCTURE_ITEMS])
    if not isinstance(structure, (tuple, list)) or len(structure) != 2:
        raise ValueError("args_structure must be a pair (args, kwargs)")
    args, kwargs = structure
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        raise ValueError("args_structure must be (args: tuple|list, kwargs: dict)")

    def unmask(value: Any) -> Any:
        if not (isinstance(value, bytes) and value.startswith(MARKER_PREFIX)):
            return value
        digits = value[len(MARKER_PREFIX) :]
        if not digits.isdigit() or len(digits) > 9:
            raise ValueError(f"malformed tensor marker {value!r:.50} in args_structure")
        index = int(digits)
        if index >= len(tensors):
            raise ValueError(f"args_structure refers to tensor {index}, but only {len(tensors)} tensors were sent")
        return tensors[index]

    return tuple(_replace(args, unmask)), _replace(kwargs, unmask)
