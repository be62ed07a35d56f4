"""What each collective computes, in numpy, in the order our ring computes it, so a check can demand the same bits:
floating-point reductions are exact only in their order. Pure (numpy only)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from . import layout
from .steps import divide
from ..sched.reduce import UFUNCS


def ring_reference(xs: Sequence[np.ndarray], op: str) -> np.ndarray:
    """What a ring allreduce of `xs` (one array per rank) computes, in its order: chunk c starts at rank c + 1 and
    each later rank applies `mine OP arrived`, ending at rank c (which divides it, for "avg")."""
    n = len(xs)
    out = np.empty_like(xs[0])
    for c, piece in enumerate(layout.chunks(xs[0].size, n)):
        part = slice(piece.start, piece.start + piece.length)
        out[part] = chain_reference([x[part] for x in xs], op, c)
    return out


def chain_reference(xs: Sequence[np.ndarray], op: str, last: int) -> np.ndarray:
    """xs reduced along the ring from rank last + 1 to rank `last`, each rank applying `mine OP arrived`: a reduce
    to root `last`, and each chunk of a ring allreduce."""
    n, ufunc = len(xs), UFUNCS["sum" if op == "avg" else op]
    acc = xs[(last + 1) % n].copy()
    with np.errstate(all="ignore"):  # overflow to inf, integer wrap: what the kernels do too
        for k in range(2, n + 1):
            acc = ufunc(xs[(last + k) % n], acc)
    return divide(acc, n) if op == "avg" else acc


def expected(kind: str, xs: Sequence[np.ndarray], op: str, root: int) -> list[np.ndarray | None]:
    """Each rank's result of collective `kind` on the ranks' inputs `xs` (x as each rank passes it); None where a
    rank's out is left as it was (reduce and gather but at the root)."""
    n = len(xs)
    if kind == "allreduce":
        return [ring_reference(xs, op)] * n
    if kind == "reduce_scatter":
        whole, part = ring_reference(xs, op), xs[0].size // n
        return [whole[r * part:(r + 1) * part] for r in range(n)]
    if kind == "reduce":
        return [chain_reference(xs, op, root) if r == root else None for r in range(n)]
    if kind == "allgather":
        return [np.concatenate(xs)] * n
    if kind == "gather":
        return [np.concatenate(xs) if r == root else None for r in range(n)]
    if kind == "broadcast":
        return [xs[root]] * n
    if kind == "scatter":
        part = xs[root].size // n
        return [xs[root][r * part:(r + 1) * part] for r in range(n)]
    if kind == "sendrecv":
        return [xs[(r - 1) % n] for r in range(n)]
    if kind == "alltoall":
        part = xs[0].size // n
        return [np.concatenate([x[r * part:(r + 1) * part] for x in xs]) for r in range(n)]
    raise ValueError(f"no reference for {kind!r}")
