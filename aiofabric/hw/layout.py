"""`Layout`: a precompiled `struct.Struct` whose format is read off the generated ctypes bindings.

The bindings (`aiofabric.autogen.bnxt`, generated from Linux's headers) say where every field of every host-interface
structure lives, but a ctypes instance per CQE or WQE is far too slow for the data path. `Layout.of(binding, names)`
packs the named fields: their offsets, sizes and integer widths come from the binding, everything between them is
padding, and the result is an ordinary `struct.Struct` (little-endian, as the hardware is): `pack`, `unpack_from`,
`pack_into` at C speed. `fields` keeps where each packed field came from, so tests/unit/test_hw.py checks every layout
against the bindings again (a hand edit of a format is caught there).
"""
from __future__ import annotations

import ctypes
import dataclasses
import struct
from typing import Any

_INTEGER_CODES = {1: "B", 2: "H", 4: "I", 8: "Q"}  # unsigned integers by byte width


@dataclasses.dataclass(frozen=True)
class Field:
    """One packed field: the binding and field it came from, where that binding starts in the layout (`base`), and the
    field's byte offset and size in the layout."""
    binding: type[ctypes.Structure]
    name: str
    base: int
    offset: int
    size: int
    count: int  # values it packs: 1, or the length of an array field (rq_wqe_hdr.wr_id packs 2)


def field_type(binding: type[ctypes.Structure], name: str) -> Any:
    """The ctypes type of field `name` of `binding` (an array type for array fields)."""
    return next(entry[1] for entry in binding._fields_ if entry[0] == name)


def _padding(size: int) -> str:
    return f"{size}x" if size else ""


class Layout(struct.Struct):
    """A `struct.Struct` that knows which binding fields it packs (`fields`, in order)."""

    def __init__(self, fmt: str, fields: tuple[Field, ...]) -> None:
        super().__init__(fmt)
        self.fields = fields

    @classmethod
    def of(cls, binding: type[ctypes.Structure], *names: str) -> Layout:
        """The named fields of `binding`, in order, at the binding's offsets. The struct spans the whole binding
        (trailing reserved bytes are padding), so `size` is the entry's size and `unpack_from(view, offset)` reads
        one entry."""
        fields, parts, position = [], [], 0
        for name in names:
            descriptor = getattr(binding, name)
            if descriptor.offset < position:
                raise ValueError(f"{binding.__name__}.{name} is listed out of order or twice")
            kind = field_type(binding, name)
            count = getattr(kind, "_length_", 1)  # an array field packs one value per element
            code = _INTEGER_CODES[ctypes.sizeof(kind) // count]
            parts.append(_padding(descriptor.offset - position) + (f"{count}{code}" if count > 1 else code))
            fields.append(Field(binding, name, 0, descriptor.offset, descriptor.size, count))
            position = descriptor.offset + descriptor.size
        return cls("<" + "".join(parts) + _padding(ctypes.sizeof(binding) - position), tuple(fields))

    def __add__(self, other: Layout) -> Layout:
        """`other` right after this one: one struct over both (a WQE header and its first SGE in one unpack)."""
        moved = tuple(dataclasses.replace(field, base=field.base + self.size, offset=field.offset + self.size)
                      for field in other.fields)
        return Layout(self.format + other.format.lstrip("<"), self.fields + moved)

    def __repr__(self) -> str:
        bindings = dict.fromkeys(field.binding.__name__ for field in self.fields)
        return f"<Layout {' + '.join(bindings)} {self.format!r}: {', '.join(f.name for f in self.fields)}>"
