"""The one reader of a vLLM command line: what vLLM 0.32's own parser will take from it.

vLLM reads its arguments in two stages, and this module follows both:

1. ``FlexibleArgumentParser`` rewrites the list: in a ``--flag`` name (up to the first ``.``) every
   ``_`` becomes ``-``; ``-O3`` and ``-O 3`` become ``--optimization-level 3``; a dotted argument
   (``--compilation-config.level 3``, ``-sc.model=x``) is a field of a JSON option and takes the
   next argument unless written with ``=``.
2. argparse reads the rest: an option is found by its exact name, by ``NAME=VALUE``, by an
   unambiguous prefix of a long name (``--shutdown-t`` is ``--shutdown-timeout``), or by a
   one-letter short option joined to its value (``-qfp8``); it takes as many values as the option
   declares (:mod:`.flags`, generated from the installed vLLM); the last occurrence wins,
   except for options that append.

Every part of the runtime that reads or edits the vLLM command goes through :func:`read`, so that
what the runtime announces and enforces (drain time, port, scheduler class, data-parallel size, ...)
is what vLLM runs with, however the operator spelled it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from carbonforge_runtime.runtime.vllm_cli.flags import FLAGS, Kind

#: Everything from the first ``--`` to the first ``.``: the part of a flag vLLM rewrites.
_NAME_PART = re.compile(r"(?<=--)[^.]*")
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
_OPTIMIZATION_LEVELS = ("0", "1", "2", "3")


def normalise(arg: str) -> str:
    """vLLM's spelling fix-up of one argument: ``_`` -> ``-`` in a ``--flag`` name (before any ``.``
    or ``=``); anything else is returned unchanged."""
    if not arg.startswith("--"):
        return arg
    key, sep, value = arg.partition("=")
    return _NAME_PART.sub(lambda m: m.group(0).replace("_", "-"), key, count=1) + sep + value


def flag_name(knob: str) -> str:
    """The flag of a vLLM knob as recipes name it: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + knob.replace("_", "-")


@dataclass(frozen=True)
class Occurrence:
    """One option as vLLM reads it, and where it stands in the argument list."""

    #: The option it belongs to (``--data-parallel-size`` for ``-dp``, ``--enable-x`` for
    #: ``--no-enable-x``), or the normalised name of an option vLLM does not know.
    flag: str
    #: The argument as written.
    written: str
    values: tuple[str, ...]
    #: ``args[start:end]`` is the whole occurrence (the flag and its values).
    start: int
    end: int
    kind: Kind | None
    #: ``"level"`` for ``--compilation-config.level``: a field of a JSON option.
    field: str | None = None

    @property
    def known(self) -> bool:
        return self.kind is not None


def _lookup(name: str) -> tuple[str, str, Kind, str | None] | None:
    """(option string, option, kind, joined value) for a flag name as argparse resolves it, or None.
    ``name`` has no ``=`` part; a joined value comes only from a short option (``-qfp8``)."""
    if name in FLAGS:
        option, kind = FLAGS[name]
        return name, option, kind, None
    if name.startswith("--"):
        matches = [o for o in FLAGS if o.startswith(name)]
    else:
        short, joined = name[:2], name[2:]
        matches = [o for o in FLAGS if o == short or (o.startswith(name) and not o.startswith("--"))]
        if matches == [short]:
            option, kind = FLAGS[short]
            return short, option, kind, joined
    if len(matches) != 1:
        return None  # unknown, or an ambiguous abbreviation: vLLM refuses either
    option, kind = FLAGS[matches[0]]
    return matches[0], option, kind, None


def _option_like(arg: str) -> bool:
    """Whether argparse takes ``arg`` for an option rather than a value (``_parse_optional``)."""
    if not arg.startswith("-") or arg == "-":
        return False
    if arg in FLAGS or arg == "--":
        return True
    name = arg.split("=", 1)[0]
    if name in FLAGS:
        return True
    if _lookup(name) is not None or _ambiguous(name):
        return True
    return not (_NEGATIVE_NUMBER.match(arg) or " " in arg)


def _ambiguous(name: str) -> bool:
    """An abbreviation several long options start with: argparse takes it for an option, and refuses it."""
    return name.startswith("--") and sum(o.startswith(name) for o in FLAGS) > 1


def _dotted(arg: str) -> bool:
    """Whether vLLM takes ``arg`` for a field of a JSON option (``--x.y``, ``-x.y=v``)."""
    return arg.startswith("-") and "." in arg.split("=", 1)[0]


def _prepared(args: Sequence[str]) -> list[tuple[str, int]]:
    """The arguments after vLLM's rewriting, each with the index of the argument it came from."""
    out: list[tuple[str, int]] = []
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            out.append((normalise(arg), i))
        elif arg.startswith("-O") and arg != "-O":
            level = arg[3:] if arg[2:3] == "=" else arg[2:]
            out += [("--optimization-level", i), (level, i)]
        elif arg == "-O" and i + 1 < len(args) and args[i + 1] in _OPTIMIZATION_LEVELS:
            out.append(("--optimization-level", i))
        else:
            out.append((arg, i))
    return out


class VllmArgs:
    """A vLLM argument list, read once; query it by option (``--shutdown-timeout``), in any spelling."""

    def __init__(self, args: Sequence[str]) -> None:
        self.args = tuple(args)
        self.occurrences: tuple[Occurrence, ...]
        #: Arguments that belong to no option (the model, when first; vLLM refuses any later one).
        self.positionals: tuple[str, ...]
        self.occurrences, self.positionals = self._read()

    def _read(self) -> tuple[tuple[Occurrence, ...], tuple[str, ...]]:
        found: list[Occurrence] = []
        # vLLM's own pass: a field of a JSON option takes the next argument unless written with '=';
        # vLLM merges the fields into the option and hands the rest to argparse.
        items: list[tuple[str, int]] = []
        prepared = _prepared(self.args)
        at = 0
        while at < len(prepared):
            arg, origin = prepared[at]
            at += 1
            if not _dotted(arg):
                items.append((arg, origin))
                continue
            name, sep, inline = arg.partition("=")
            base, _, path = name.partition(".")
            resolved = _lookup(base)
            values = (inline,) if sep else tuple(a for a, _ in prepared[at:at + 1])
            at += 0 if sep else len(values)
            found.append(Occurrence(resolved[1] if resolved else base, self.args[origin], values, origin,
                                    self._end(prepared, at, origin), resolved[2] if resolved else None, field=path))
        # argparse's pass.
        loose: list[str] = []
        at = 0
        while at < len(items):
            arg, origin = items[at]
            at += 1
            if arg == "--":
                loose += [a for a, _ in items[at:]]
                break
            if not _option_like(arg):
                loose.append(arg)
                continue
            resolved = _lookup(arg) if arg in FLAGS else None
            name, sep, inline = ("", "", "") if resolved else arg.partition("=")
            resolved = resolved or _lookup(name)
            if resolved is None:
                # Unknown to vLLM (it will refuse it): read the values it seems to have.
                values = (inline,) if sep else self._values(items, at, "many")
                at += 0 if sep else len(values)
                found.append(Occurrence(name, self.args[origin], values, origin, self._end(items, at, origin), None))
                continue
            _, option, kind, joined = resolved
            if sep or joined:
                values = (inline if sep else joined or "",)
            else:
                values = self._values(items, at, kind)
                at += len(values)
            found.append(Occurrence(option, self.args[origin], values, origin, self._end(items, at, origin), kind))
        found.sort(key=lambda o: o.start)
        return tuple(found), tuple(loose)

    @staticmethod
    def _values(items: list[tuple[str, int]], at: int, kind: Kind) -> tuple[str, ...]:
        if kind in ("on", "off"):
            return ()
        out: list[str] = []
        while at < len(items) and not _option_like(items[at][0]):
            out.append(items[at][0])
            at += 1
            if kind in ("one", "optional", "append"):
                break
        return tuple(out)

    @staticmethod
    def _end(items: list[tuple[str, int]], at: int, origin: int) -> int:
        return max(origin, items[at - 1][1]) + 1 if at > 0 else origin + 1

    # --- queries ---------------------------------------------------------------------------------

    def all(self, flag: str) -> list[Occurrence]:
        """Every occurrence of the option ``flag`` (its canonical long name), JSON fields excluded."""
        return [o for o in self.occurrences if o.flag == flag and o.field is None]

    def given(self, flag: str) -> bool:
        """Whether ``flag`` is given in any spelling (its ``--no-`` form and its fields included)."""
        return any(o.flag == flag for o in self.occurrences)

    def last(self, flag: str) -> Occurrence | None:
        """The occurrence vLLM keeps: the last one."""
        found = self.all(flag)
        return found[-1] if found else None

    def values(self, flag: str) -> list[str] | None:
        """The values vLLM keeps for ``flag`` (the last occurrence's; every one's for an appending
        option); None when it is not given."""
        found = self.all(flag)
        if not found:
            return None
        if found[-1].kind == "append":
            return [v for o in found for v in o.values]
        return list(found[-1].values)

    def value(self, flag: str) -> str | None:
        """The single value vLLM keeps for ``flag``; None when it is not given or has no value."""
        values = self.values(flag)
        return values[0] if values else None

    def switch(self, flag: str) -> bool | None:
        """A boolean option's setting: True (``--flag``), False (``--no-flag``), None when not given."""
        occurrence = self.last(flag)
        return None if occurrence is None else occurrence.kind != "off"

    def without(self, flags: Iterable[str]) -> list[str]:
        """The argument list with every occurrence of these options removed (fields included)."""
        drop = set(flags)
        spans = [(o.start, o.end) for o in self.occurrences if o.flag in drop]
        return [arg for i, arg in enumerate(self.args) if not any(start <= i < end for start, end in spans)]


def read(args: Sequence[str]) -> VllmArgs:
    """Read a vLLM argument list (without the ``python -m MODULE`` prefix)."""
    return VllmArgs(args)
