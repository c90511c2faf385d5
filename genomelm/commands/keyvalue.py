"""`key=value` arguments for the commands that once took `--flags` (`genomelm data`, `genomelm export`), the
style every other command uses. The old flags are still read, each with a one-line deprecation notice on
stderr naming its `key=value` spelling."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field


class ArgumentError(ValueError):
    """A command line that cannot be read; the message names the argument and the fix."""


@dataclass(frozen=True)
class Option:
    """One `key=value` setting: its help text, and whether it is a switch (its old flag takes no value)."""

    help: str
    switch: bool = False
    repeatable: bool = False  # repeated keys (and repeated old flags) collect into a list
    flag: str = ""  # the old flag, when it is not `--` + the key with dashes
    negate: bool = False  # the old flag switches it off (`--no-progress`: progress=false)


@dataclass
class Parsed:
    positional: list[str] = field(default_factory=list)
    settings: dict[str, str | list[str]] = field(default_factory=dict)
    help: bool = False


def old_flag(key: str, option: Option) -> str:
    return option.flag or "--" + key.replace("_", "-")


def parse(argv: list[str], options: dict[str, Option], prog: str) -> Parsed:
    """Positional arguments and `key=value` settings (keys as in `options`; `-` and `_` alike); `--flag
    value`, `--flag=value` and switches `--flag` read as their key, with a deprecation line each."""
    flags = {old_flag(key, option): key for key, option in options.items()}
    parsed = Parsed()

    def put(key: str, value: str) -> None:
        if options[key].repeatable:
            existing = parsed.settings.setdefault(key, [])
            assert isinstance(existing, list)
            existing.append(value)
        else:
            parsed.settings[key] = value

    items = iter(argv)
    for item in items:
        if item in ("-h", "--help"):
            parsed.help = True
        elif item.startswith("--"):
            name, has_value, value = item.partition("=")
            key = flags.get(name)
            if key is None:
                raise ArgumentError(
                    f"unknown option {name}; settings are key=value (`{prog} --help` lists them)"
                )
            option = options[key]
            if option.switch:
                value = value if has_value else ("false" if option.negate else "true")
            elif not has_value:
                value = next(items, None)
                if value is None:
                    raise ArgumentError(f"{name} needs a value: write {key}=VALUE")
            print(f"{prog}: {name} is deprecated; write {key}={value}", file=sys.stderr)
            put(key, value)
        elif "=" in item:
            key, value = item.split("=", 1)
            key = key.strip().lower().replace("-", "_")
            if key not in options:
                known = ", ".join(options)
                raise ArgumentError(f"unknown setting {key!r} in {item!r}; known: {known}")
            put(key, value)
        else:
            parsed.positional.append(item)
    return parsed


def usage(prog: str, synopsis: str, description: str, options: dict[str, Option], epilog: str = "") -> str:
    """The `--help` text: synopsis, description, each setting and its old flag."""
    width = max(len(key) for key in options) + 7
    lines = [f"usage: {prog} {synopsis}", "", description, "", "settings (key=value):"]
    for key, option in options.items():
        value = "true|false" if option.switch else "VALUE"
        lines.append(f"  {f'{key}={value}':<{width + 4}} {option.help} (was {old_flag(key, option)})")
    if epilog:
        lines += ["", epilog]
    return "\n".join(lines)


TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")


def as_switch(key: str, value: str) -> bool:
    """A switch's value: true/false (yes/no, on/off, 1/0)."""
    if value.lower() in TRUE_WORDS:
        return True
    if value.lower() in FALSE_WORDS:
        return False
    raise ArgumentError(f"{key}={value}: give true or false")
