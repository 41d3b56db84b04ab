"""Generate ``reference/config.md``: every key of mgpu-train's structured configs, the options of every config group
and every recipe, read from the code and the YAML files at build time (run by mkdocs-gen-files).

A key added to a dataclass of ``lightning_mgpu.cli.config``, an option added to ``conf/`` or a recipe added to
``recipes/`` appears here without editing any page. A key's description is the ``#:`` comment after it on its line,
or the ``#:`` comment lines just above it, as the source holds them.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import tokenize
import typing
from typing import Any

import mkdocs_gen_files
import yaml
from omegaconf import MISSING

from lightning_mgpu import MGPUStrategy
from lightning_mgpu.cli import config as schema
from lightning_mgpu.cli.paths import conf_dir, recipes_dir

PAGE = "reference/config.md"
#: Sphinx roles of the code's docstrings (:class:`X`), shown as inline code.
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|const):`~?([^`]+)`")


def as_code(text: str) -> str:
    """A docstring's text as Markdown: Sphinx roles and RST literals become inline code."""
    return ROLE.sub(r"`\1`", text).replace("``", "`")


def docstring_args(obj: Any) -> dict[str, str]:
    """{argument: its description} from the ``Args:`` section of a Google-style docstring."""
    out: dict[str, str] = {}
    lines = (inspect.getdoc(obj) or "").splitlines()
    if "Args:" not in lines:
        return out
    name = None
    for line in lines[lines.index("Args:") + 1:]:
        if line and not line.startswith(" "):
            break
        match = re.match(r"^    (\w+): (.*)$", line)
        if match:
            name = match.group(1)
            out[name] = match.group(2).strip()
        elif name and line.startswith("        "):
            out[name] += " " + line.strip()
    return out


#: Where a key's description comes from when its field has no #: comment: the argument it is passed as.
FALLBACK = {schema.ParallelConfig: ("MGPUStrategy", docstring_args(MGPUStrategy))}


# ------------------------------------------------------------------------------------------------ source comments
def field_comments(cls: type) -> dict[str, str]:
    """{field name: its ``#:`` comment} of a dataclass, read from the source with the tokenizer."""
    lines, first = inspect.getsourcelines(cls)
    source = "".join(lines)
    comments: dict[int, str] = {}  # line (1-based, within the class source) -> the #: comment on it
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.string.startswith("#:"):
            comments[tok.start[0]] = tok.string[2:].strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT,
                              tokenize.ENDMARKER):
            code_lines.add(tok.start[0])
    out: dict[str, str] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        name = stripped.split(":", 1)[0].strip()
        if name not in names or ":" not in stripped or number not in code_lines or name in out:
            continue
        if number in comments and not stripped.startswith("#"):  # comment after the field, on its line
            out[name] = comments[number]
            continue
        above, n = [], number - 1
        while n >= 1 and n in comments and lines[n - 1].strip().startswith("#:"):
            above.insert(0, comments[n])
            n -= 1
        if above:
            out[name] = " ".join(above)
    return out


# ------------------------------------------------------------------------------------------------ types and values
def nested_dataclass(tp: Any) -> tuple[type | None, bool]:
    """(the dataclass a field holds, whether it is a list of them), or (None, False)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return tp, False
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return nested_dataclass(inner[0])
    if origin in (list, typing.List) and args and dataclasses.is_dataclass(args[0]):
        return args[0], True
    return None, False


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any"
    if tp is type(None):
        return "null"
    if origin is typing.Union:
        return " or ".join(type_name(a) for a in args)
    if origin in (list, typing.List):
        return f"list[{type_name(args[0])}]" if args else "list"
    if dataclasses.is_dataclass(tp):
        return tp.__name__
    return getattr(tp, "__name__", str(tp))


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return MISSING


def yaml_value(value: Any) -> str:
    """A value as it is written on the command line or in YAML."""
    if value is MISSING or value == MISSING:
        return "???"
    if dataclasses.is_dataclass(value):
        return "{...}"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value) if value != value.strip() or value == "" else value
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "&#124;").replace("\n", " ")


def code(text: str) -> str:
    return f"<code>{cell(text.replace('&', '&amp;').replace('<', '&lt;').replace('>', '&gt;'))}</code>"


# ------------------------------------------------------------------------------------------------ the composed default
def composed_defaults() -> dict:
    """What ``mgpu-train`` composes with no override (the groups' default options over the schema)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    schema.register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose("config")
    return OmegaConf.to_container(cfg, resolve=False)


def lookup(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return dataclasses.MISSING
        tree = tree[part]
    return tree


# ------------------------------------------------------------------------------------------------ the page
def section(cls: type, prefix: str, composed: dict, out: list[str], nested: list[tuple[type, str]]) -> None:
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    if cls in FALLBACK:
        owner, args = FALLBACK[cls]
        for name in (f.name for f in dataclasses.fields(cls)):
            if name not in comments and name in args:
                comments[name] = f"{owner}({name}=...): " + as_code(args[name])
    doc = inspect.getdoc(cls) or ""
    if doc and not doc.startswith(cls.__name__ + "("):
        out += [as_code(doc), ""]
    out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        inner, is_list = nested_dataclass(hints[f.name])
        default = yaml_value(default_of(f))
        if inner is not None:
            sub = f"{key}[]" if is_list else key
            nested.append((inner, sub + "."))
            anchor = sub.replace("[]", "")
            default = default if is_list else ("null" if default_of(f) is None else "{...}")
            description = comments.get(f.name, "") + (" " if f.name in comments else "") + \
                f"see [`{sub}`](#{anchor.replace('.', '-')}) below"
        else:
            description = comments.get(f.name, "")
        value = lookup(composed, key) if not prefix.endswith("[].") else dataclasses.MISSING
        shown = code(default)
        if value is not dataclasses.MISSING and inner is None and yaml_value(value) != default:
            shown += f" (mgpu-train: {code(yaml_value(value))})"
        elif value is not dataclasses.MISSING and inner is not None and value is not None and default == "null":
            shown += " (mgpu-train: selected)"
        out.append(f"| `{key}`{{#{key}}} | {code(type_name(hints[f.name]))} | {shown} | "
                   f"{cell(description)} |")
    out.append("")


def group_options() -> list[str]:
    out = ["## Config groups", "",
           "Choose an option of a group with `GROUP=NAME` on the command line (`model=llama3_8b`); its file in "
           "`conf/GROUP/` sets the keys below, and any key can still be overridden after it. `mgpu-train` starts from "
           "the defaults of `conf/config.yaml`: " + ", ".join(f"`{d}`" for d in default_choices()) + ".", ""]
    for group in sorted(p.name for p in conf_dir().iterdir() if p.is_dir()):
        out += [f"### `{group}`", "", "| option | sets | about |", "| --- | --- | --- |"]
        for path in sorted((conf_dir() / group).glob("*.yaml")):
            text = path.read_text()
            body = yaml.safe_load(text) or {}
            package = "" if "# @package _global_" in text else f"{group}."
            sets = [f"{package}{k}={yaml_value(v)}" for k, v in flatten(body)]
            for entry in body.get("defaults", []) if isinstance(body, dict) else []:
                for k, v in (entry.items() if isinstance(entry, dict) else []):
                    sets.insert(0, f"{k.replace('override /', '')}={v}")
            out.append(f"| `{group}={path.stem}` | {'<br>'.join(code(s) for s in sets)} | "
                       f"{cell(leading_comment(text))} |")
        out.append("")
    return out


def default_choices() -> list[str]:
    defaults = yaml.safe_load((conf_dir() / "config.yaml").read_text())["defaults"]
    return [f"{k}={v}" for d in defaults if isinstance(d, dict) for k, v in d.items() if v is not None]


def flatten(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if not isinstance(tree, dict) or not tree:
        return [(prefix.rstrip("."), tree)] if prefix else []
    out = []
    for k, v in tree.items():
        if prefix == "" and k == "defaults":
            continue
        out += flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [(f"{prefix}{k}", v)]
    return out


def leading_comment(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def recipes() -> list[str]:
    out = ["## Recipes", "",
           "`mgpu-train recipe=NAME` (and `mgpu-plan recipe=NAME`) applies `recipes/NAME.yaml` over the defaults; any "
           "override on the same command line still applies after it. Each file, as it ships:", ""]
    for path in sorted(recipes_dir().glob("*.yaml")):
        out += [f"### `recipe={path.stem}`", "", "```yaml", path.read_text().rstrip(), "```", ""]
    return out


def page() -> str:
    composed = composed_defaults()
    out = ["# Configuration keys", "",
           "Generated at build time from the structured configs of `lightning_mgpu.cli.config` (the dataclasses that "
           "type every key: a typo'd key or a wrong type is refused at composition), the option files of `conf/` and "
           "the recipes of `recipes/`. *default* is the schema's; where `mgpu-train` with no override composes "
           "another value (a group's default option sets it), that value follows in parentheses. `???` is a value "
           "that must be given. Set any key on the command line as `key=value` (`trainer.devices=8`); "
           "`mgpu-train --cfg job` prints the composed configuration.", ""]
    top = [f for f in dataclasses.fields(schema.TrainConfig)]
    hints = typing.get_type_hints(schema.TrainConfig)
    comments = field_comments(schema.TrainConfig)
    out += ["## Top level", "", "| key | type | default | description |", "| --- | --- | --- | --- |"]
    groups: list[tuple[type, str]] = []
    for f in top:
        inner, _ = nested_dataclass(hints[f.name])
        if inner is not None:
            groups.append((inner, f.name + "."))
            out.append(f"| `{f.name}` | {code(inner.__name__)} | | see [`{f.name}`](#{f.name}) |")
        else:
            out.append(f"| `{f.name}`{{#{f.name}}} | {code(type_name(hints[f.name]))} | "
                       f"{code(yaml_value(default_of(f)))} | {cell(comments.get(f.name, ''))} |")
    out.append("")
    while groups:
        cls, prefix = groups.pop(0)
        name = prefix[:-1]
        out += [f"## `{name}` {{#{name.replace('[]', '').replace('.', '-')}}}", ""]
        nested: list[tuple[type, str]] = []
        section(cls, prefix, composed, out, nested)
        groups[0:0] = nested  # nested sections follow their parent
    out += group_options()
    out += recipes()
    return "\n".join(out) + "\n"


with mkdocs_gen_files.open(PAGE, "w") as fh:
    fh.write(page())
