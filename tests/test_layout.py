"""The package layout's rules, checked by walking real imports (and, for schemes, the syntax tree).

Layers, top to bottom (a module imports only its own layer or lower ones):
  cli -> offline tools (registry, plan, launch, demo) -> train -> weights
      -> engines / data / checkpoint -> storage / ops / models -> config / distributed / errors
Only storage/ knows URI schemes and S3 (test_only_storage_knows_schemes_and_s3).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bigclip"

LAYER = {
    "bigclip": 0,
    "bigclip.errors": 0,
    "bigclip.named_objects": 0,
    "bigclip.config": 0,
    "bigclip.cli_args": 0,
    "bigclip.cli_help": 0,
    "bigclip.openclip_flags": 0,
    "bigclip.distributed": 0,
    "bigclip.storage": 1,
    "bigclip.ops": 1,
    "bigclip.models": 1,
    "bigclip.engines": 2,
    "bigclip.data": 2,
    "bigclip.checkpoint": 2,
    "bigclip.weights": 3,
    "bigclip.train": 4,
    "bigclip.registry": 5,
    "bigclip.plan": 5,
    "bigclip.launch": 5,
    "bigclip.demo": 5,
    "bigclip.cli": 6,
    "bigclip.__main__": 6,  # `python -m bigclip`: the console script's entry
}
# Upward imports that are allowed, each inside a function (so importing the lower module does
# not load the higher one), with the reason.
LAZY_UPWARD = {
    ("bigclip.config", "bigclip.models"): "ModelConfig.validate checks --model against the model configs",
    ("bigclip.weights", "bigclip.registry"): "--pretrained registry:NAME opens the registry only then",
    ("bigclip.config", "bigclip.storage"): "LogConfig.validate asks storage whether --logs is a URI",
}
# The storage seam: outside bigclip/storage/, no module imports the S3 modules (bigclip.storage.s3
# and every bigclip.storage.s3_*), and none tests a URI's scheme: a string literal holding "://"
# is never an operand of ==, !=, in, not in, nor an argument of startswith, endswith,
# removeprefix or removesuffix (a tuple of them included). Composing a URI (the demo's loopback
# bucket) and naming s3:// in help and messages is fine; deciding by scheme is storage's
# (`schemes.is_local`, `open_location`). Literals that are no storage scheme, with the reason:
NOT_STORAGE = {"env://": "--dist-url: torch.distributed's rendezvous method, not an object store"}
PREFIX_TESTS = ("startswith", "endswith", "removeprefix", "removesuffix")
OFFLINE = (
    "bigclip.registry",
    "bigclip.plan",
    "bigclip.launch",
    "bigclip.demo",
    "bigclip.weights.consolidate",
    "bigclip.weights.open_clip_export",
    "bigclip.weights.hf_tokenizer_files",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    """The entry of LAYER a module belongs to: its longest matching prefix."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYER:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} is in no layer: add its package to LAYER in {__file__}")


def bigclip_imports(path: Path, *, include_type_only: bool = False) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import of a bigclip module in the file;
    `if TYPE_CHECKING:` imports only with `include_type_only`."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    type_only = {id(n) for node in ast.walk(tree) if _is_type_checking_block(node) for n in ast.walk(node)}
    if include_type_only:
        type_only = set()
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue  # `if TYPE_CHECKING:` imports are for annotations and never run
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bigclip"):
            names = [f"{node.module}.{a.name}" for a in node.names]
            found += [(n if is_submodule(n) else node.module, id(node) in top_level) for n in names]
        elif isinstance(node, ast.Import):
            found += [(a.name, id(node) in top_level) for a in node.names if a.name.startswith("bigclip")]
    return found


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def is_submodule(name: str) -> bool:
    """Whether `from pkg import name` imports a submodule (a file or package of that name)."""
    relative = Path(*name.split("."))
    return (PACKAGE.parent / relative).with_suffix(".py").exists() or (PACKAGE.parent / relative).is_dir()


def all_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_imports_a_higher_layer():
    problems = []
    for path in all_modules():
        source = module_name(path)
        for target, at_top in bigclip_imports(path):
            a, b = room(source), room(target)
            if LAYER[b] <= LAYER[a]:
                continue
            if (a, b) in LAZY_UPWARD and not at_top:
                continue
            problems.append(f"{source} imports {target} ({a} is below {b})")
    assert not problems, "\n".join(problems)


def import_graph(*, include_type_only: bool) -> dict[str, set[str]]:
    """bigclip module -> the bigclip modules it imports: at module level, inside functions and,
    with `include_type_only`, under `if TYPE_CHECKING:`."""
    graph = {}
    for path in all_modules():
        source = module_name(path)
        found = bigclip_imports(path, include_type_only=include_type_only)
        graph[source] = {target for target, _ in found if target != source}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in graph:
                continue  # a name that is no module of the tree (checked by the layer rule)
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_engines_and_linear_kinds_see_models_only_through_the_contract():
    """engines/ and ops/ import nothing of models/ but models/contract.py: the model contract is
    all an engine or a low-precision linear kind may know of a model."""
    problems = []
    for path in all_modules():
        source = module_name(path)
        if not source.startswith(("bigclip.engines", "bigclip.ops")):
            continue
        for target, _ in bigclip_imports(path, include_type_only=True):
            if target.startswith("bigclip.models") and target != "bigclip.models.contract":
                problems.append(f"{source} imports {target}")
    assert not problems, "use bigclip.models.contract instead:\n" + "\n".join(problems)


# What of models/ the planner (plan/) and consolidation (weights/consolidate*.py and its OpenCLIP
# and transformers exports) may import, with the reason: the contract's static half, which describes a model by its
# --model name without torch and without building it.
STATIC_CONTRACT = {
    "bigclip.models.shape": "ModelShape and its parts, ModelOptions, ModelFamily: what a model is",
    "bigclip.models.families": "the family a --model name belongs to, and its shape: the lookup",
    "bigclip.models.flops": "the one FLOP count, derived from a shape (the training log's MFU uses it too)",
    "bigclip.models.run_options": "a run's model options from its flags, what its name builds with",
}
DRY_RUN = (
    "an engine kind's dry run builds the model the training loop builds, through the same entry "
    "(build_model, model_factory), and shards it with the real engine"
)
MODEL_BUILDERS = {  # (importer, imported): why it builds the real model
    ("bigclip.plan.fsdp_plan", "bigclip.models.from_config"): DRY_RUN,
    ("bigclip.plan.zero_plan", "bigclip.models.from_config"): DRY_RUN,
}
SEES_MODELS_STATICALLY = (
    "bigclip.plan", "bigclip.weights.consolidate", "bigclip.weights.open_clip_export",
    "bigclip.weights.transformers_export",
)  # fmt: skip


def test_the_planner_and_consolidation_see_models_only_through_the_static_contract():
    """plan/ and consolidation import nothing of models/ but STATIC_CONTRACT (and MODEL_BUILDERS):
    they price and check any model family from its shape, CLIP or not."""
    problems = []
    for path in all_modules():
        source = module_name(path)
        if not source.startswith(SEES_MODELS_STATICALLY):
            continue
        for target, _ in bigclip_imports(path, include_type_only=True):
            allowed = target in STATIC_CONTRACT or (source, target) in MODEL_BUILDERS
            if target.startswith("bigclip.models") and not allowed:
                problems.append(f"{source} imports {target}")
    assert not problems, f"use {', '.join(STATIC_CONTRACT)} instead:\n" + "\n".join(problems)


def test_no_import_cycles():
    """Modules import each other in one direction only. Every import counts: module-level ones,
    those inside functions (a lazy import still makes the two modules depend on each other; it
    only hides the circle until that function runs) and `if TYPE_CHECKING:` ones (type
    checkers and `typing.get_type_hints` run them). The fix is to move the shared name down
    into a module both can import."""
    cycles = import_cycles(import_graph(include_type_only=True))
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def is_s3_module(name: str) -> bool:
    parts = name.split(".")
    return parts[:2] == ["bigclip", "storage"] and len(parts) > 2 and parts[2].partition("_")[0] == "s3"


def _uri_literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and "://" in node.value:
        return [] if node.value in NOT_STORAGE else [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for element in node.elts for v in _uri_literals(element)]
    return []


def scheme_tests(source: str) -> list[str]:
    """'line N: literal' for each scheme test in `source` (see NOT_STORAGE's comment)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        operands: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in PREFIX_TESTS
        ):
            operands = list(node.args)
        found += [f"line {node.lineno}: {literal!r}" for op in operands for literal in _uri_literals(op)]
    return found


def test_only_storage_knows_schemes_and_s3():
    problems = []
    for path in all_modules():
        source = module_name(path)
        if room(source) == "bigclip.storage":
            continue
        imports = {target for target, _ in bigclip_imports(path, include_type_only=True)}
        problems += [f"{source} imports {target}" for target in sorted(imports) if is_s3_module(target)]
        problems += [f"{source} tests a scheme, {where}" for where in scheme_tests(path.read_text())]
    assert not problems, (
        "open a location (bigclip.storage.locations) or ask bigclip.storage.schemes:\n" + "\n".join(problems)
    )


def test_the_scheme_check_finds_scheme_tests_and_s3_imports():
    code = (
        'a = uri.startswith(("s3://", "gs://"))\nb = "://" in uri\nc = f"s3://{bucket}/x"\nd = x == "env://"'
    )
    assert scheme_tests(code) == ["line 1: 's3://'", "line 1: 'gs://'", "line 2: '://'"]
    assert is_s3_module("bigclip.storage.s3_location") and is_s3_module("bigclip.storage.s3")
    assert not is_s3_module("bigclip.storage.sinks") and not is_s3_module("bigclip.storage.schemes")


def loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_training_loads_no_offline_tool():
    loaded = loaded_after("import bigclip.train.trainer")
    offenders = sorted(m for m in loaded if m.startswith(OFFLINE))
    assert not offenders, f"importing bigclip.train loads offline tools: {offenders}"


def test_models_load_no_engine_data_or_training_code():
    loaded = loaded_after("import bigclip.models, bigclip.models.from_config")
    offenders = sorted(
        m for m in loaded if m.startswith(("bigclip.engines", "bigclip.data", "bigclip.train"))
    )
    assert not offenders, offenders


def test_cli_help_imports_no_torch():
    """`bigclip --help` stays instant: subcommands import their modules only when run."""
    loaded = loaded_after("import bigclip.cli")
    assert "torch" not in loaded


def test_every_package_says_what_lives_there_and_what_it_may_import():
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if init.parent == PACKAGE:
            continue  # the root's docstring is the project's one-liner
        assert len(doc.splitlines()) >= 3 and "import" in doc.lower(), (
            f"{init}: docstring must say what it may import"
        )
