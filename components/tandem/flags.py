"""Command-line flags generated from the config dataclasses (`tandem.config`), and back.

`flags_of(Config)` lists a config's flags (nested dataclass fields, such as a frontend's `router`,
contribute theirs); `add_flags` puts them on a parser, grouped by the dataclass that declares them,
with the field's help, converter, choices and default; `build(Config, namespace)` turns parsed
values back into the config; `render` turns a value back into argv, which is how `tandem up`
forwards flags to its children without declaring any of them again.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Flag:
    path: tuple[str, ...]  # field names from the config root, e.g. ("router", "policy")
    flag: str  # "--router-policy"
    field: dataclasses.Field[Any]
    owner: type  # the dataclass that declares the field: its docstring titles the help group

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        return self.field.default

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.field.metadata


def _owner(cls: type, name: str) -> type:
    for klass in cls.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            return klass
    return cls


def flag_name(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("flag") or "--" + f.name.replace("_", "-"))


def flags_of(cls: type, *, exclude: Iterable[str] = ()) -> list[Flag]:
    """Every flag of `cls` (a config dataclass), in declaration order, less the fields named in
    `exclude` (dotted paths for nested ones: "router.policy")."""
    skip = set(exclude)
    out: list[Flag] = []

    def walk(klass: type, prefix: tuple[str, ...]) -> None:
        for f in dataclasses.fields(klass):
            path = (*prefix, f.name)
            if ".".join(path) in skip or not f.metadata.get("cli", False):
                continue
            if dataclasses.is_dataclass(f.default):
                walk(type(f.default), path)
                continue
            out.append(Flag(path, flag_name(f), f, _owner(klass, f.name)))

    walk(cls, ())
    # Help reads best as: what every process takes, this command's own, then sections (mixins
    # such as the mock engine's knobs, nested configs such as the router's).
    root = cls.__mro__[-2]
    return sorted(out, key=lambda f: (0 if f.owner is root else 1 if f.owner is cls else 2))


_METAVARS = {"positive_int": "N", "non_negative_int": "N", "port": "PORT", "port_or_zero": "PORT",
             "positive_float": "X", "non_negative_float": "X"}


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if value != "" else "none"


def _converter(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = convert.__name__
    return parse


def help_text(flag: Flag) -> str:
    text = str(flag.meta["help"])
    if flag.meta.get("required"):
        return text + " (required)"
    if "(default:" in text:
        return text
    return f"{text} (default: {_show(flag.default)})"


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag], *, forwarded: bool = False,
              title: Callable[[type], str] | None = None) -> None:
    """Add `flags` to `parser`, one argument group per declaring dataclass. With `forwarded`, a
    flag left out leaves nothing in the namespace (so only what was given is forwarded) and none is
    required."""
    groups: dict[type, Any] = {}
    seen: set[str] = set()
    for flag in flags:
        if flag.flag in seen:
            continue
        seen.add(flag.flag)
        if flag.owner not in groups:
            doc = (title(flag.owner) if title else (flag.owner.__doc__ or "").strip())
            groups[flag.owner] = parser.add_argument_group(" ".join(doc.split()))
        kwargs: dict[str, Any] = {"dest": flag.dest, "help": help_text(flag)}
        kwargs["default"] = argparse.SUPPRESS if forwarded else flag.default
        if isinstance(flag.default, bool):  # off by default: --X; on by default: --X/--no-X
            kwargs["action"] = _OnOff if flag.default else "store_true"
        else:
            choices = flag.meta.get("choices")
            if choices:
                kwargs["choices"] = choices
            if "type" in flag.meta:
                kwargs["type"] = _converter(flag.meta["type"])
            metavar = flag.meta.get("metavar") or _METAVARS.get(getattr(flag.meta.get("type"),
                                                                        "__name__", ""))
            if metavar and not choices:
                kwargs["metavar"] = metavar
            kwargs["required"] = bool(flag.meta.get("required")) and not forwarded
        groups[flag.owner].add_argument(flag.flag, **kwargs)


class _OnOff(argparse.BooleanOptionalAction):
    """`--X` / `--no-X` for a flag that is on by default; its help says the default once."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # (without the help, to which it would add the default)
        self.help = help


def build(cls: type[T], ns: argparse.Namespace, **overrides: Any) -> T:
    """The config `cls` from parsed flags (a flag not in `ns` keeps its default); `overrides` set
    top-level fields that have no flag. Raises ValueError from the config's own checks."""

    def make(klass: type, prefix: tuple[str, ...]) -> Any:
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(klass):
            if dataclasses.is_dataclass(f.default):
                kwargs[f.name] = make(type(f.default), (*prefix, f.name))
            elif f.metadata.get("cli", False):
                dest = flag_name(f).lstrip("-").replace("-", "_")
                if hasattr(ns, dest):
                    kwargs[f.name] = getattr(ns, dest)
        if not prefix:
            kwargs.update(overrides)
        return klass(**kwargs)

    result: T = make(cls, ())
    return result


def render(flag: Flag, value: Any) -> list[str]:
    """argv that makes a parser built by `add_flags` read `value` for `flag`."""
    if isinstance(flag.default, bool):
        if value == flag.default:
            return []
        return [flag.flag] if value else ["--no-" + flag.flag[2:]]
    if isinstance(value, tuple):
        return [flag.flag, ",".join(map(str, value))]
    if isinstance(value, float):
        return [flag.flag, repr(value)]
    return [flag.flag, str(value)]


def render_given(flags: Iterable[Flag], ns: argparse.Namespace) -> list[str]:
    """argv for every flag in `flags` that `ns` holds a value for (see `add_flags(forwarded=)`)."""
    argv: list[str] = []
    for flag in flags:
        if hasattr(ns, flag.dest):
            argv += render(flag, getattr(ns, flag.dest))
    return argv
