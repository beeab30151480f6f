"""The docs name only things that exist, so a rename that forgets a page fails here.

Read: README.md, CONTRIBUTING.md, CHANGELOG.md, benchmarks/README.md and every docs/*.md (in CHANGELOG's
"Renamed" sections only the new side of each `old -> new` line). In their code (inline `spans`, fenced
blocks), each thing is checked once per page, at its first mention:

- every dotted `nanocore.…` / `nanocore_plugins.…` name (and `from nanocore.x import y`) imports, and its
  attributes resolve;
- every CamelCase name in a span (`ProcessGrid`) is defined in the code, or is another project's name
  listed in EXTERNAL_NAMES; every hook name (`register_…`, `on_…`) is a hook of nanocore/hookspecs.py;
- every `nanocore <command> [<sub-command>] --flag` is a command and flag of the real parser
  (`nanocore.commands.cli.build_parser`, with the commands plugins register), and every
  `run_train.py` / `run_generate.py` flag is one of those scripts';
- every config key path in a span (`parallelism.pp_engine`, `data_stages[0].data.seed`, the key of a
  `key.path=value` override) is a field of the attrs classes in nanocore/config/schema.py, or of a plugin's
  config class where the schema hands a section to a plugin (`model.model_config`; the optimizer's, dataset
  format's and logger's flattened options), or a nanotron key the config accepts;
- every repository path (`plugins/llama/model.py`, `nanocore/`, `examples/...`) and relative link exists;
- docs/plugins.md's list of public modules covers what plugin code imports and what the page tells
  plugins to use.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from nanocore.config import nanotron, schema

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [
        *(REPO / name for name in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md", "benchmarks/README.md")),
        *(REPO / "docs").glob("*.md"),
    ]
)
# docs/code_map.md is redrawn at the end of issue 19 (the plugins/parallel refactor); until then it may lag.
REDRAWN_LATER = {"code_map.md"}

# Config keys a doc may name before they exist: fixed in GUIDE §2 for the issues after 19. Each entry says
# which issue brings it; remove it when that key lands (the test then checks it like any other).
PLANNED_KEYS: dict[str, str] = {}

FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.S | re.M)
SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOTTED = re.compile(r"(?<![\w./-])(nanocore(?:_plugins)?(?:\.[A-Za-z_]\w*)+)")
SECTIONS = "|".join(attrs.fields_dict(schema.Config))
KEY = re.compile(rf"(?<![\w./\-\[$])((?:{SECTIONS})(?:\[\d*\])?(?:\.(?:\w+|\*)(?:\[\d*\])?)+)(?![\w/(\-]|\.[\w*])")
# `model.layers.N.mlp`, `model.layers.*.self_attn`: a segment that is a layer index makes it a module name
LAYER_INDEX = re.compile(r"^(\d+|N|\*|[a-z])$")
FROM_IMPORT = re.compile(
    r"^[ \t]*from[ \t]+(nanocore(?:_plugins)?[\w.]*)[ \t]+import[ \t]+(?:\(([\w,\s]+)\)|([\w, \t]+))", re.M
)
FILE_EXTENSIONS = {"py", "md", "yaml", "yml", "json", "jsonl", "txt", "safetensors", "bin", "pt", "toml", "sh"}
PATH = re.compile(
    r"(?<![\w./-])((?:nanocore|plugins|tests|examples|benchmarks|docs|\.ci)/[\w./*-]*|"
    r"(?:run_train|run_generate)\.py|pyproject\.toml|README\.md|CONTRIBUTING\.md|CHANGELOG\.md)"
)
COMMAND = re.compile(r"(?:^|&&|;|\||\$|python -m)[ \t]*nanocore[ \t]+([a-z][\w-]*)(.*)", re.M)
SCRIPT = re.compile(r"(run_train|run_generate)\.py((?:[ \t]+[^ \t\n]+)*)")
SHELL_END = re.compile(r"&&|\|\||[|;>#`]")
FLAG = re.compile(r"^(--?[A-Za-z][\w-]*)")


@attrs.frozen
class Ref:
    doc: Path
    line: int
    text: str

    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}: {self.text!r}"


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _changelog_renames(doc: Path, text: str) -> str:
    """CHANGELOG's "Renamed" lists name the old names on purpose: keep only the new side of `old -> new`."""
    if doc.name != "CHANGELOG.md":
        return text
    out, in_renames = [], False
    for line in text.split("\n"):
        if line.startswith("#"):
            in_renames = "renamed" in line.lower()
        elif in_renames and "->" in line:
            old, new = line.rsplit("->", 1)
            # blank out the old side but keep its length, so offsets (line numbers) stay true
            line = re.sub(r"[^\n]", " ", old) + "  " + new
        out.append(line)
    return "\n".join(out)


@functools.cache
def code_of(doc: Path) -> tuple[list[Ref], list[Ref]]:
    """(inline spans, fenced blocks) of `doc`, each with the line it starts on."""
    text = _changelog_renames(doc, doc.read_text())
    blocks = [Ref(doc, _line_of(text, m.start(2)), m.group(2)) for m in FENCE.finditer(text)]
    # blank the blocks out (keeping newlines) so spans are only looked for in prose
    prose = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    spans = [Ref(doc, _line_of(prose, m.start(2)), m.group(2)) for m in SPAN.finditer(prose)]
    return spans, blocks


def _docs() -> list[Path]:
    return [d for d in DOCS if d.exists()]


def _params(found: Iterator[Ref]) -> list:
    return [pytest.param(ref, id=f"{ref.doc.relative_to(REPO)}:{ref.line}:{ref.text}") for ref in found]


def fail(ref: Ref, problem: str) -> None:
    if ref.doc.name in REDRAWN_LATER:
        pytest.xfail(f"redrawn at the end of issue 19: {ref.where()}: {problem}")
    pytest.fail(f"{ref.where()}: {problem}", pytrace=False)


def _all_code() -> Iterator[Ref]:
    for doc in _docs():
        spans, blocks = code_of(doc)
        yield from spans
        yield from blocks


def _unique(refs: Iterator[Ref]) -> list[Ref]:
    seen: dict[tuple, Ref] = {}
    for ref in refs:
        seen.setdefault((ref.doc, ref.text), ref)
    return list(seen.values())


# -- dotted names ----------------------------------------------------------------------------------


def dotted_names() -> list[Ref]:
    found = []
    for ref in _all_code():
        for m in DOTTED.finditer(ref.text):
            if m.group(1).rsplit(".", 1)[-1] not in FILE_EXTENSIONS:  # `nanocore.yaml` is a file name
                found.append(Ref(ref.doc, ref.line + ref.text.count("\n", 0, m.start()), m.group(1)))
        for m in FROM_IMPORT.finditer(ref.text):
            line = ref.line + ref.text.count("\n", 0, m.start())
            for name in re.split(r"[\s,]+", (m.group(2) or m.group(3)).strip()):
                if name and name != "as":
                    found.append(Ref(ref.doc, line, f"{m.group(1)}.{name}"))
    return _unique(iter(found))


def _has_member(obj: object, name: str) -> bool:
    if hasattr(obj, name):
        return True
    if isinstance(obj, type):
        if attrs.has(obj) and name in attrs.fields_dict(obj):
            return True
        # a Protocol's attribute declared by annotation only (`vocab_size: int`)
        return any(name in getattr(klass, "__annotations__", {}) for klass in obj.__mro__)
    return False


def resolve_dotted(name: str) -> None:
    parts = name.split(".")
    obj: object = importlib.import_module(parts[0])
    done = parts[0]
    for part in parts[1:]:
        if isinstance(obj, types.ModuleType) and not hasattr(obj, part) and hasattr(obj, "__path__"):
            obj = importlib.import_module(f"{done}.{part}")  # a sub-module not imported by its package
        elif _has_member(obj, part):
            if not hasattr(obj, part):
                return  # declared by annotation only: nothing further to walk into
            obj = getattr(obj, part)
        else:
            raise AssertionError(f"{done} has no attribute {part!r}")
        done = f"{done}.{part}"


@pytest.mark.parametrize("ref", _params(dotted_names()))
def test_dotted_name_resolves(ref: Ref) -> None:
    try:
        resolve_dotted(ref.text)
    except (ImportError, AssertionError) as exc:
        fail(ref, f"does not resolve: {exc}")


# -- class names and hook names ---------------------------------------------------------------------

CAMEL = re.compile(r"(?<![\w.])([A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+)(?!\w)")
HOOK = re.compile(r"(?<![\w.])(register_\w+|on_[a-z_]+_(?:start|end|saved))(?!\w)")
IDENTIFIER_SPAN = re.compile(r"[\w.]+(?:\(.*\))?")
# Names from other projects the docs compare with: transformers' and nanotron's.
EXTERNAL_NAMES = {
    "AutoModelForCausalLM",  # transformers
    "MixtralTopKRouter",  # transformers
    "AdamWOptimizerArgs",  # nanotron
    "ExistingCheckpointInit",  # nanotron
    "PretrainDatasetsArgs",  # nanotron
    "RandomInit",  # nanotron
    "VmHWM",  # Linux, /proc/self/status
}


@functools.cache
def _defined_names() -> frozenset[str]:
    """Every class, function and module-level or class-level name the code defines."""
    source = "\n".join(
        path.read_text()
        for folder in ("nanocore", "plugins", "examples", "benchmarks")
        for path in (REPO / folder).rglob("*.py")
    )
    found = set(re.findall(r"(?:class|def)\s+(\w+)", source)) | set(re.findall(r"^\s*(\w+)\s*[:=]", source, re.M))
    return frozenset(found)


def class_names() -> list[Ref]:
    """CamelCase names in spans that are a name or a call (`ProcessGrid`, `Engine.step(...)`)."""
    found = []
    for doc in _docs():
        for ref in code_of(doc)[0]:
            if IDENTIFIER_SPAN.fullmatch(ref.text.strip()):
                found += [
                    Ref(doc, ref.line, m.group(1)) for m in CAMEL.finditer(ref.text) if not DOTTED.match(ref.text)
                ]
    return _unique(iter(found))


@pytest.mark.parametrize("ref", _params(class_names()))
def test_class_name_is_defined(ref: Ref) -> None:
    if ref.text not in _defined_names() | EXTERNAL_NAMES:
        fail(ref, "no class, function or attribute of that name in nanocore/, plugins/, examples/ or benchmarks/")


def hook_refs() -> list[Ref]:
    """Hook names in spans and in plugin code (blocks with `@hookimpl`; others may quote an error's typo)."""
    found = []
    for doc in _docs():
        spans, blocks = code_of(doc)
        for ref in spans + [block for block in blocks if "@hookimpl" in block.text]:
            found += [
                Ref(doc, ref.line + ref.text.count("\n", 0, m.start()), m.group(1)) for m in HOOK.finditer(ref.text)
            ]
    return _unique(iter(found))


@pytest.mark.parametrize("ref", _params(hook_refs()))
def test_hook_exists(ref: Ref) -> None:
    from nanocore.plugins import hook_names

    if ref.text not in hook_names():
        fail(ref, "no such hook (nanocore/hookspecs.py)")


# -- commands and flags ----------------------------------------------------------------------------


@functools.cache
def _parsers() -> dict[str, argparse.ArgumentParser]:
    """The parsers the CLI itself uses: `nanocore` with every plugin command, and the two scripts'."""
    from nanocore.commands import cli
    from nanocore.plugins import load_plugins

    commands = {entry.name: entry for entry in load_plugins().registries.command}
    parsers = {"nanocore": cli.build_parser(commands)}
    for script in ("train", "generate"):
        parsers[f"run_{script}.py"] = cli._standalone_parser(script, f"run_{script}.py")
    return parsers


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _words(rest: str) -> list[str]:
    """The command's own words: up to the end of the shell command, brackets and quotes stripped."""
    end = SHELL_END.search(rest)
    rest = rest[: end.start()] if end else rest
    return [w.strip("[](){}'\",") for w in rest.split()]


def commands() -> list[Ref]:
    found = []
    for doc in _docs():
        spans, blocks = code_of(doc)
        # a span wraps with the prose around it; a block continues a line with a backslash
        lines = [Ref(doc, r.line, " ".join(r.text.split("\n"))) for r in spans]
        lines += [Ref(doc, r.line, r.text.replace("\\\n", " ")) for r in blocks]
        for ref in lines:
            for m in COMMAND.finditer(ref.text):
                line = ref.line + ref.text.count("\n", 0, m.start())
                found.append(Ref(doc, line, f"nanocore {m.group(1)}{m.group(2)}".rstrip()))
            for m in SCRIPT.finditer(ref.text):
                line = ref.line + ref.text.count("\n", 0, m.start())
                found.append(Ref(doc, line, f"{m.group(1)}.py{m.group(2)}".rstrip()))
    return _unique(iter(found))


def check_command(text: str) -> list[str]:
    """What in the command line `text` the real parser does not know."""
    program, *words = _words(text)
    parser = _parsers()[program]
    problems = []
    options: set[str] = set(parser._option_string_actions)
    subs = _subcommands(parser)
    for word in words:
        if word.startswith("-"):
            flag = FLAG.match(word)
            if flag and flag.group(1) not in options:
                problems.append(f"{program}: no option {flag.group(1)}")
        elif subs:
            if word not in subs:
                problems.append(f"{program}: no command {word!r} (has: {', '.join(sorted(subs))})")
                break
            parser = subs[word]
            program = f"{program} {word}"
            options |= set(parser._option_string_actions)
            subs = _subcommands(parser)
    return problems


@pytest.mark.parametrize("ref", _params(commands()))
def test_command_and_flags_exist(ref: Ref) -> None:
    problems = check_command(ref.text)
    if problems:
        fail(ref, "; ".join(problems))


# -- config keys -----------------------------------------------------------------------------------


def config_keys() -> list[Ref]:
    found = []
    for doc in _docs():
        for ref in code_of(doc)[0]:
            for m in KEY.finditer(ref.text):
                key = m.group(1)
                segments = key.split(".")
                if segments[-1] in FILE_EXTENSIONS or any(LAYER_INDEX.match(part) for part in segments[1:]):
                    continue
                found.append(Ref(ref.doc, ref.line + ref.text.count("\n", 0, m.start()), key))
    return _unique(iter(found))


@functools.cache
def _plugin_config_classes(kind: str) -> tuple[type, ...]:
    from nanocore.plugins import load_plugins

    registry = load_plugins().registries[kind]
    return tuple(entry.config_class for entry in registry if entry.config_class is not None)


# Sections the schema types `Any` and hands to a plugin: (class, field) -> (registry kind, flattened?).
# A flattened section's keys sit beside the selecting name in YAML (`optimizer_factory: {name: sgd, momentum: 0.9}`).
PLUGIN_SECTIONS = {
    (schema.ModelArgs, "model_config"): ("model", False),
    (schema.OptimizerFactory, "args"): ("optimizer", True),
    (schema.DatasetSpec, "args"): ("dataset_format", True),
    (schema.LoggerSpec, "options"): ("logger", True),
}
# Keys a section takes besides its classes' fields (YAML path -> keys): `model_type` selects the model plugin.
# (nanotron's `is_llama_config: true` says `model_type: llama`).
SELECTOR_KEYS = {"model.model_config": {"model_type", "is_llama_config"}}


def _attrs_classes(tp: object) -> list[type]:
    """The attrs classes a field's type holds (through Optional, list, dict values)."""
    if isinstance(tp, type) and attrs.has(tp):
        return [tp]
    return [c for arg in typing.get_args(tp) for c in _attrs_classes(arg)]


def _fields(cls: type) -> dict[str, list[type]]:
    """Each YAML key of `cls` -> the attrs classes below it (several where a plugin decides)."""
    hints = typing.get_type_hints(cls)
    keys: dict[str, list[type]] = {}
    for field in attrs.fields(cls):
        section = PLUGIN_SECTIONS.get((cls, field.name))
        if section is None:
            keys[field.name] = _attrs_classes(hints[field.name])
            continue
        kind, flattened = section
        plugin_classes = list(_plugin_config_classes(kind))
        if flattened:
            for plugin_class in plugin_classes:
                for name, below in _fields(plugin_class).items():
                    keys.setdefault(name, []).extend(below)
        else:
            keys[field.name] = plugin_classes
    return keys


def resolve_key(path: str) -> str | None:
    """None when `path` names a config key; else what is wrong."""
    parts = path.split(".")
    classes: list[type] = [schema.Config]
    walked = ""
    for part in parts:
        name = re.sub(r"\[\d*\]$", "", part)
        options: dict[str, list[type]] = {}
        for cls in classes:
            for key, below in _fields(cls).items():
                options.setdefault(key, []).extend(below)
        for key in SELECTOR_KEYS.get(re.sub(r"\[\d*\]", "", walked), ()):
            options.setdefault(key, [])
        if name not in options:
            if name in nanotron.accepted_keys(walked):
                return None  # a nanotron key the config accepts (ignored or renamed)
            return f"{walked or 'the config'} has no key {name!r}"
        classes = options[name]
        walked = f"{walked}.{part}" if walked else part
        if not classes and part is not parts[-1]:
            return None  # a plain value (or a plugin section with no class): nothing below to check
    return None


@pytest.mark.parametrize("ref", _params(config_keys()))
def test_config_key_exists(ref: Ref) -> None:
    if ref.text in PLANNED_KEYS:
        pytest.skip(f"planned: {PLANNED_KEYS[ref.text]}")
    problem = resolve_key(ref.text)
    if problem is not None:
        fail(ref, problem)


# -- paths and links -------------------------------------------------------------------------------


def paths() -> list[Ref]:
    found = []
    for ref in _all_code():
        for m in PATH.finditer(ref.text):
            found.append(Ref(ref.doc, ref.line + ref.text.count("\n", 0, m.start()), m.group(1)))
    for doc in _docs():
        text = _changelog_renames(doc, doc.read_text())
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            found.append(Ref(doc, _line_of(text, m.start()), "link:" + target))
    return _unique(iter(found))


def path_exists(ref: Ref) -> bool:
    if ref.text.startswith("link:"):
        target = ref.text.removeprefix("link:").split("#")[0]
        return (ref.doc.parent / target).exists()
    path = re.sub(r"(::.*|:\d+.*)$", "", ref.text).rstrip(".,:;")
    if "*" in path:
        return any(REPO.glob(path))
    return (REPO / path).exists()


@pytest.mark.parametrize("ref", _params(paths()))
def test_path_exists(ref: Ref) -> None:
    if not path_exists(ref):
        fail(ref, "no such file or folder")


def test_the_docs_are_read() -> None:
    """The extractors find what the docs obviously contain (a broken pattern would pass everything)."""
    names = {ref.text for ref in dotted_names()}
    assert {"nanocore.moe_api.MoELayer", "nanocore.sequence_api.SequenceRuntime", "nanocore.hookimpl"} <= names
    assert any(ref.text.startswith("nanocore plan") for ref in commands())
    keys = {ref.text for ref in config_keys()}
    assert {"parallelism.pp_engine", "optimizer.zero_stage", "parallelism.expert_parallel_size"} <= keys
    assert {"link:docs/parallelism.md", "plugins/parallel/grid.py", "run_train.py"} <= {ref.text for ref in paths()}
    assert "ProcessGrid" in {ref.text for ref in class_names()}
    assert "register_pipeline_schedules" in {ref.text for ref in hook_refs()}


# -- the public modules a plugin may import ---------------------------------------------------------

PUBLIC = re.compile(r"A plugin should import only `nanocore`'s public modules \(((?:`[\w.]+`,?\s*)+)\)")


def _imported_core_modules(source: str) -> set[str]:
    """The `nanocore` modules `source` imports (`from nanocore.x import y` -> nanocore.x)."""
    found = set(re.findall(r"^\s*from\s+(nanocore(?:\.[\w.]+)?)\s+import", source, re.M))
    found |= set(re.findall(r"^\s*import\s+(nanocore(?:\.[\w.]+)?)", source, re.M))
    return found


def _module_of(name: str) -> str | None:
    """`nanocore.x` for `nanocore.x.Name` (or `nanocore.x.Name.attr`); None when `name` is itself a module."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        try:
            importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        return None if end == len(parts) else ".".join(parts[:end])
    return None


def test_public_modules_cover_what_plugin_code_imports() -> None:
    """docs/plugins.md's list of public modules holds every core module that the page's plugin code, the
    example plugin packages and the local plugin files import, and every module it lists imports."""
    doc = REPO / "docs" / "plugins.md"
    listed = PUBLIC.search(" ".join(doc.read_text().split()))
    assert listed, "docs/plugins.md no longer says which modules a plugin may import"
    public = set(re.findall(r"`([\w.]+)`", listed.group(1)))
    for module in public:
        importlib.import_module(module)
    # what the page tells a plugin to use: the module of each `nanocore.module.name` it names (the `trainer`
    # hooks receive and the pipeline simulator a schedule author runs are handed over or run, not imported)
    named = {_module_of(ref.text) for ref in dotted_names() if ref.doc == doc} - {None}
    not_imported = {"nanocore.trainer", "nanocore.pipeline_sim"}
    assert not named - public - not_imported, (
        f"docs/plugins.md tells plugins to use {sorted(named - public - not_imported)}"
    )
    users = {f"docs/plugins.md block at line {b.line}": b.text for b in code_of(doc)[1]}
    plugin_files = [*(REPO / "examples" / "plugins").rglob("*.py"), *(REPO / "examples" / "local_plugins").glob("*.py")]
    users |= {str(path.relative_to(REPO)): path.read_text() for path in plugin_files if "tests" not in path.parts}
    outside = {
        where: sorted(_imported_core_modules(source) - public)
        for where, source in users.items()
        if _imported_core_modules(source) - public
    }
    assert not outside, f"plugin code imports core modules docs/plugins.md does not list as public: {outside}"
