"""A minimal stand-in for ``einops.rearrange`` and ``einops.repeat``, written for flashtile's compatibility
runner: flash-attn's test file imports einops, which a machine without network may lack. The runner puts
this directory on PYTHONPATH only when the real einops is missing.

Supported patterns: named axes, parenthesised groups on either side, ``1`` (a unit axis), ``...`` (also
inside a group), and new axes on the right (named, with their size given as a keyword, or an integer
literal) for ``repeat``.
"""

from __future__ import annotations

import math

import torch

_ELLIPSIS = "..."


def _parse_side(side: str) -> list[str | list[str]]:
    """'b (s h) ... d' -> ['b', ['s', 'h'], '...', 'd']: bare axes as strings, groups as lists."""
    items: list[str | list[str]] = []
    current: list[str] | None = None
    for token in side.replace("(", " ( ").replace(")", " ) ").split():
        if token == "(":
            if current is not None:
                raise ValueError(f"nested parentheses in {side!r}")
            current = []
        elif token == ")":
            if current is None:
                raise ValueError(f"unbalanced parentheses in {side!r}")
            items.append(current)
            current = None
        elif current is not None:
            current.append(token)
        else:
            items.append(token)
    if current is not None:
        raise ValueError(f"unbalanced parentheses in {side!r}")
    return items


def _groups(items: list[str | list[str]], names: list[str]) -> list[list[str]]:
    """One list of elementary axes per dimension: a bare '...' becomes one dimension per ellipsis axis, a
    '...' inside a group the ellipsis axes merged there."""
    groups = []
    for item in items:
        if item == _ELLIPSIS:
            groups.extend([name] for name in names)
        elif isinstance(item, str):
            groups.append([item])
        else:
            expanded = []
            for atom in item:
                expanded.extend(names if atom == _ELLIPSIS else [atom])
            groups.append(expanded)
    return groups


def _is_literal(atom: str) -> bool:
    return atom.isdigit()


def _transform(tensor: torch.Tensor, pattern: str, sizes: dict[str, int], allow_new: bool) -> torch.Tensor:
    left_text, right_text = pattern.split("->")
    left_items, right_items = _parse_side(left_text), _parse_side(right_text)
    if any(isinstance(item, list) and _ELLIPSIS in item for item in left_items):
        raise ValueError("'...' on the left must stand alone, not inside a group")
    has_ellipsis = _ELLIPSIS in left_items
    extra = tensor.dim() - (len(left_items) - (1 if has_ellipsis else 0))
    if extra < 0 or (not has_ellipsis and extra != 0):
        raise ValueError(f"pattern {pattern!r} does not match a tensor of {tensor.dim()} dimensions")
    ellipsis_names = [f"{_ELLIPSIS}{i}" for i in range(extra if has_ellipsis else 0)]
    left, right = _groups(left_items, ellipsis_names), _groups(right_items, ellipsis_names)

    # Sizes of the left's elementary axes; unit axes ('1', '()') are dropped from them.
    axis_size: dict[str, int] = {}
    elementary: list[str] = []
    for group, dim_size in zip(left, tensor.shape):
        atoms = [a for a in group if a != "1"]
        unknown = [a for a in atoms if not _is_literal(a) and a not in sizes]
        known = math.prod(int(a) if _is_literal(a) else sizes[a] for a in atoms if a not in unknown)
        if len(unknown) > 1:
            raise ValueError(f"cannot infer the sizes of {unknown} in {pattern!r}: give all but one")
        if unknown:
            if known == 0 or dim_size % known:
                raise ValueError(f"dimension of size {dim_size} does not split by {known} in {pattern!r}")
            axis_size[unknown[0]] = dim_size // known
        elif known != dim_size:
            raise ValueError(f"dimension of size {dim_size} is not {known} in {pattern!r}")
        for position, atom in enumerate(atoms):
            name = atom if not _is_literal(atom) else f"{atom}#{len(elementary)}#{position}"
            axis_size.setdefault(name, int(atom) if _is_literal(atom) else sizes.get(atom, axis_size.get(atom)))
            elementary.append(name)
    tensor = tensor.reshape([axis_size[name] for name in elementary])

    right_atoms = [a for group in right for a in group]
    for atom in right_atoms:
        if atom in elementary or atom == "1" or _is_literal(atom):
            continue
        if not allow_new:
            raise ValueError(f"axis {atom!r} appears only on the right of {pattern!r}")
        if atom not in sizes:
            raise ValueError(f"size of new axis {atom!r} not given")
    missing = [name for name in elementary if name not in right_atoms]
    if missing and not all("#" in name for name in missing):
        raise ValueError(f"axes {missing} of the left are missing on the right of {pattern!r}")
    kept = [name for name in right_atoms if name in elementary]
    tensor = tensor.permute([elementary.index(name) for name in kept])
    view, target = [], []
    for atom in right_atoms:
        if atom in elementary:
            view.append(axis_size[atom])
            target.append(axis_size[atom])
        else:
            view.append(1)
            target.append(1 if atom == "1" else (int(atom) if _is_literal(atom) else sizes[atom]))
    tensor = tensor.reshape(view).expand(target)
    shape = [math.prod(target[i] for i in range(start, start + len(group)))
             for start, group in zip([sum(len(g) for g in right[:j]) for j in range(len(right))], right)]
    return tensor.reshape(shape)


def rearrange(tensor: torch.Tensor, pattern: str, **sizes: int) -> torch.Tensor:
    """einops.rearrange: reorder, split and merge axes (no new axes but unit ones)."""
    return _transform(tensor, pattern, sizes, allow_new=False)


def repeat(tensor: torch.Tensor, pattern: str, **sizes: int) -> torch.Tensor:
    """einops.repeat: rearrange, plus new axes (sizes as keywords, or integer literals) copied along."""
    return _transform(tensor, pattern, sizes, allow_new=True)


__all__ = ["rearrange", "repeat"]
