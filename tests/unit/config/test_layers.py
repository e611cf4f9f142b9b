"""The package's layer order (the table in ``megatron_apriel/__init__.py``), checked against the
imports the code really makes (every ``import`` statement, also those inside functions)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_apriel

PACKAGE = Path(megatron_apriel.__file__).parent
STDLIB = set(sys.stdlib_module_names)
LEAF_THIRD_PARTY = {"pydantic", "numpy", "hydra", "omegaconf", "psutil"}

def layer_table() -> list[tuple[int, list[list[str]]]]:
    """(layer, sides) rows from the package docstring; each side is a list of dotted names. A layer
    written on several lines has one side."""
    rows: dict[int, list[list[str]]] = {}
    for line in megatron_apriel.__doc__.splitlines():
        head, sep, names = line.strip().partition(":")
        number = head.split(" ", 1)[0]
        if sep and number.isdigit():
            sides = [side.split() for side in names.split("|")]
            if int(number) in rows:
                assert len(sides) == 1 and len(rows[int(number)]) == 1, f"layer {number}: one side per line"
                rows[int(number)][0] += sides[0]
            else:
                rows[int(number)] = sides
    return sorted(rows.items())


LAYERS = layer_table()


def module_names() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return [m for m in out if m]


def place(module: str) -> tuple[int, int]:
    """(layer, side) of a module: a ``*.`` pattern first, else the longest matching name of the table."""
    best = None
    for layer, sides in LAYERS:
        for side, names in enumerate(sides):
            for name in names:
                if name.startswith("*."):
                    hit, weight = module.endswith(name[1:]) or module == name[2:], 10_000
                else:
                    hit, weight = module == name or module.startswith(name + "."), len(name)
                if hit and (best is None or weight > best[0]):
                    best = (weight, layer, side)
    if best is None:
        raise AssertionError(f"megatron_apriel.{module} is in no layer: add it to the table in "
                             "megatron_apriel/__init__.py")
    return best[1], best[2]


def imports(module: str, top_level_only: bool = False) -> set[str]:
    """Modules imported by ``module``, as dotted names (ours relative to the package)."""
    path = PACKAGE.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m.removeprefix("megatron_apriel.") if m.startswith("megatron_apriel.") else m for m in out
            if m != "megatron_apriel"}


def ours(name: str) -> bool:
    return (PACKAGE / name.split(".")[0]).exists() or (PACKAGE / (name.split(".")[0] + ".py")).exists()


MODULES = module_names()
LIBRARY = [m for m in MODULES if not m.startswith("testing")]


def test_the_table_is_read_and_places_every_library_module():
    assert [layer for layer, _ in LAYERS] == list(range(len(LAYERS))) and len(LAYERS) >= 8
    for module in LIBRARY:
        place(module)


def test_no_module_imports_a_higher_layer_or_another_side():
    wrong = []
    for module in LIBRARY:
        layer, side = place(module)
        for target in filter(ours, imports(module)):
            if target.startswith("testing"):
                wrong.append(f"{module} imports {target}: testing/ is for tests and benchmarks only")
                continue
            t_layer, t_side = place(target)
            if t_layer > layer:
                wrong.append(f"{module} (layer {layer}) imports {target} (layer {t_layer})")
            elif t_layer == layer and t_side != side:
                wrong.append(f"{module} imports {target}: another side of layer {layer}")
    assert not wrong, "\n".join(wrong)


def test_no_entry_point_imports_another():
    found = {(m, t) for m in LIBRARY if m.startswith("entrypoints.")
             for t in imports(m) if t.startswith("entrypoints.")}
    assert found == set(), "entry points share code through the layers below them, not with each other"


@pytest.mark.parametrize("module", [m for m in LIBRARY if place(m)[0] == 0])
def test_a_leaf_imports_nothing_heavy(module):
    third_party = {t.split(".")[0] for t in imports(module, top_level_only=True)
                   if not ours(t) and t.split(".")[0] not in STDLIB and t != "__future__"}
    assert third_party <= LEAF_THIRD_PARTY, f"{module} imports {third_party - LEAF_THIRD_PARTY} at module level"


def test_importing_the_config_loads_no_torch_numpy_or_httpx():
    code = ("import sys, megatron_apriel.config\n"
            "print(' '.join(m for m in ('torch', 'numpy', 'httpx', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """The layer check can fail: a leaf that imported the trainer would be reported."""
    monkeypatch.setattr(sys.modules[__name__], "imports",
                        lambda module, top_level_only=False: {"trainer.trainer"} if module == "rewards" else set())
    with pytest.raises(AssertionError, match=r"rewards \(layer 0\) imports trainer.trainer \(layer 7\)"):
        test_no_module_imports_a_higher_layer_or_another_side()


FOLDER_CYCLES = {
    frozenset({"config", "slurm"}): "slurm.* settings live beside the SLURM code, which lays out the job from the "
                                    "whole run's config",
}
"""Pairs of top-level folders (or root modules) that import each other: each is an import that runs
back up the folders' stack. Fewer is better; a new one needs a reason here."""


def folder_cycles(edges: set[tuple[str, str]]) -> set[frozenset[str]]:
    """The imports that lie on a cycle of the folder import graph, as folder pairs."""
    nodes = {n for e in edges for n in e}
    reach = {n: {b for a, b in edges if a == n} for n in nodes}
    changed = True
    while changed:  # transitive closure: a few dozen folders
        changed = False
        for n in nodes:
            more = set().union(*(reach[m] for m in reach[n])) - reach[n]
            if more:
                reach[n] |= more
                changed = True
    return {frozenset({a, b}) for a, b in edges if a in reach[b]}


def folder_edges() -> set[tuple[str, str]]:
    return {(m.split(".")[0], t.split(".")[0]) for m in LIBRARY for t in filter(ours, imports(m))
            if m.split(".")[0] != t.split(".")[0] and not t.startswith("testing")}


def test_folders_import_each_other_only_where_listed():
    found = folder_cycles(folder_edges())
    assert found == set(FOLDER_CYCLES), (f"folders in an import cycle: {sorted(map(sorted, found))}; "
                                         f"listed: {sorted(map(sorted, FOLDER_CYCLES))}")


def test_the_cycle_finder_sees_a_longer_cycle():
    edges = {("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("e", "d")}
    assert folder_cycles(edges) == {frozenset({"a", "b"}), frozenset({"b", "c"}), frozenset({"c", "a"})}


def test_no_two_test_modules_share_a_file_name():
    """The test folders are not packages: pytest imports each module by its file name alone, so two
    modules of one name stop the whole suite at collection ("import file mismatch")."""
    tests = Path(megatron_apriel.__file__).resolve().parents[1] / "tests"
    seen: dict[str, Path] = {}
    twice = []
    for path in sorted(tests.rglob("test_*.py")):
        if path.name in seen:
            twice.append((str(seen[path.name].relative_to(tests)), str(path.relative_to(tests))))
        seen.setdefault(path.name, path)
    assert not twice, f"rename one of each pair: {twice}"
