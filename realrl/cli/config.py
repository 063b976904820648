"""`realrl config [KEY=VALUE ...] [--markdown] [--config-name NAME] [--config-dir DIR]`

Every key of the config, grouped by section, with its type, its value (the
defaults of `realrl train`, or those of the given defaults file and
overrides) and its help: the docstring under each field of the schema,
`AsyncPPOConfig` in realrl/api/cli_args.py. `--markdown` writes the
reference that docs/config.md is:

    python -m realrl config --markdown > docs/config.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap

from realrl.api.cli_args import ConfigError
from realrl.cli.trial import HelpRequested, UsageError, parse_trial_args
from realrl.experiment.config import load_config

REGENERATE = "python -m realrl config --markdown > docs/config.md"


@dataclasses.dataclass
class Key:
    name: str  # dotted, as on the command line
    type: str
    value: object  # in the composed config
    schema_default: object
    help: str


@dataclasses.dataclass
class Section:
    name: str  # the keys' dotted prefix; "" = the top level
    help: str
    keys: list[Key]


def field_docs(cls: type) -> tuple[str, dict[str, str]]:
    """(the class's docstring, {field: the docstring under it}), read from
    `cls`'s source: a string literal right after a field is its help."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return ast.get_docstring(tree.body[0]) or "", docs


def config_sections(cfg) -> list[Section]:
    """The sections of `cfg` (a config dataclass), the top level first and
    each nested section after its parent, fields in the schema's order."""
    sections: list[Section] = []

    def walk(name: str, value, schema_default, help: str) -> None:
        class_doc, docs = field_docs(type(value))
        section = Section(name, help or class_doc, [])
        sections.append(section)
        nested = []
        for f in dataclasses.fields(value):
            key = f"{name}.{f.name}" if name else f.name
            v, d = getattr(value, f.name), getattr(schema_default, f.name)
            if dataclasses.is_dataclass(v):
                nested.append((key, v, d, docs.get(f.name, "")))
            else:
                type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
                section.keys.append(Key(key, type_name, v, d, docs.get(f.name, "")))
        for args in nested:
            walk(*args)

    walk("", cfg, type(cfg)(), "")
    return sections


def format_value(value) -> str:
    """A value as an override writes it (`ppo.c_clip=null`, `plugins=[a.py]`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _value_and_default(key: Key, code: str = "") -> str:
    text = f"{code}{format_value(key.value)}{code}"
    if key.value != key.schema_default:
        text += f" (schema: {code}{format_value(key.schema_default)}{code})"
    return text


def text_reference(cfg) -> str:
    """The keys for a terminal: `key: type = value`, the help indented under it."""
    lines = []
    for section in config_sections(cfg):
        title = section.name or "top level"
        lines += ["", f"{title}: {_one_line(section.help)}" if section.help else f"{title}:"]
        for key in section.keys:
            lines.append(f"  {key.name}: {key.type} = {_value_and_default(key)}")
            lines += textwrap.wrap(_one_line(key.help), 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines).lstrip("\n") + "\n"


def markdown_reference(cfg) -> str:
    """docs/config.md: one table per section."""
    lines = [
        "# Configuration reference",
        "",
        "Every key of `realrl train` (and `python training/main_async_ppo.py`), grouped by section, with",
        "its type, its default and what it does. Set any of them on the command line",
        "(`realrl train ppo.eps_clip=0.1 rollout.n_workers=2`); `realrl config` prints this list in a",
        "terminal. The defaults are those of `realrl/configs/async-ppo.yaml` over the schema",
        "(`AsyncPPOConfig` in `realrl/api/cli_args.py`); where the file sets another value, the schema's",
        "own default follows in parentheses.",
        "",
        "Generated from the docstrings under the schema's fields by",
        f"`{REGENERATE}`; edit those, not this file.",
    ]
    for section in config_sections(cfg):
        lines += ["", f"## `{section.name}`" if section.name else "## Top level", ""]
        if section.help:
            lines += [_markdown_text(_one_line(section.help)), ""]
        lines += ["| key | type | default | help |", "|---|---|---|---|"]
        for key in section.keys:
            cells = [
                f"`{key.name}`",
                f"`{key.type}`",
                _value_and_default(key, "`"),
                _markdown_text(_one_line(key.help)),
            ]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _markdown_text(text: str) -> str:
    """Prose with `<placeholders>` and `*` shown as written (escaped outside code spans)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else re.sub(r"([<>*])", r"\\\1", p) for p in parts)


def main(argv: list[str]) -> int:
    try:
        _, overrides, options = parse_trial_args(argv, __doc__, flags=("--markdown",), positional_names=())
        cfg = load_config(overrides, options["--config-name"], options["--config-dir"])
    except HelpRequested as e:
        print(e)
        return 0
    except UsageError as e:
        print(f"realrl config: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"realrl: config error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(markdown_reference(cfg) if options["--markdown"] else text_reference(cfg))
    return 0
