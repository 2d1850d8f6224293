"""The shape of the code, checked: layers that import only downwards, one file that calls backward, a
short trainer, and a docstring that says each module's job (README's Layout is the map these keep true)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gpt2train"

# Lowest first. A module may import its own layer and the layers below it, never one above.
LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"gpt2train", "units", "ranges", "devices", "tokenizer", "distributed", "runlog"}),
    ("model", {"model", "config", "runtime", "generate"}),
    ("data", {"data", "data.sources", "data.shards", "data.prepare", "data.loader"}),
    ("storage", {"checkpoint", "hf"}),
    ("eval", {"eval", "eval.val", "eval.hellaswag", "eval.harness", "eval.run", "eval.periodic"}),
    ("train", {"train", "train.optim", "train.guard", "train.step", "train.signals", "train.console",
               "train.checkpointing", "train.runlock", "train.init_from", "train.loop"}),
    ("tools", {"bench", "bench.journey", "bench.memory", "bench.generate", "bench.quality", "bench.serve", "plan", "doctor",
               "report"}),
    # serve/ needs the optional FastAPI and uvicorn: above every other layer, so only the CLI imports it
    ("serve", {"serve", "serve.request", "serve.engine", "serve.app"}),
    ("cli", {"cli", "__main__"}),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    name = ".".join(p for p in parts if p != "__init__")
    return name or "gpt2train"


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def layer_of(name: str) -> int:
    for i, (_, members) in enumerate(LAYERS):
        if name in members:
            return i
    raise AssertionError(f"{name} is in no layer: place it in LAYERS (and in README's Layout)")


def imported(path: Path) -> set[str]:
    """The gpt2train modules a file imports, at any depth of the file (lazy imports count too)."""
    found = set()
    for node in ast.walk(library_face_removed(path, ast.parse(path.read_text()))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gpt2train":
            if node.module == "gpt2train":  # from gpt2train import distributed
                found |= {a.name if a.name in modules() else "gpt2train" for a in node.names}
            else:
                found.add(node.module.removeprefix("gpt2train."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("gpt2train.") for a in node.names if a.name.split(".")[0] == "gpt2train"}
    return {"gpt2train" if name == "gpt2train" else name for name in found}


def library_face_removed(path: Path, tree: ast.Module) -> ast.Module:
    """The package's __init__ without its library face: the PEP 562 __getattr__ and the _Package properties
    import higher layers on first access only (so `from gpt2train import train` works while `import
    gpt2train` imports nothing above it; test_import_gpt2train_is_cheap checks that). Every other
    function, and every other file, is scanned in full."""
    if path != SRC / "__init__.py":
        return tree
    face = {"__getattr__", "_Package"}
    tree.body = [node for node in tree.body if not (isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in face)]
    return tree


def test_import_gpt2train_is_cheap():
    """The library face is lazy: importing the package loads no torch and none of its higher layers."""
    code = ("import sys, gpt2train; loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('gpt2train.'));"
            "print(loaded)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(SRC.parent)},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_library_face_exemption_is_narrow(tmp_path):
    """An upward import at the package's module level is still caught."""
    assert "train.loop" in imported_as_package(tmp_path, "from gpt2train.train.loop import train\n")
    assert "train.loop" in imported_as_package(tmp_path, "def helper():\n    from gpt2train.train.loop import train\n")


def imported_as_package(tmp_path: Path, text: str) -> set[str]:
    """imported() of `text` as if it were the package's __init__ (the only file the exemption covers)."""
    tree = library_face_removed(SRC / "__init__.py", ast.parse(text))
    fake = tmp_path / "__init__.py"
    fake.write_text(ast.unparse(tree))
    return imported(fake)


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_imports_a_layer_above_it(name):
    mine = layer_of(name)
    above = sorted(dep for dep in imported(modules()[name]) if layer_of(dep) > mine)
    assert not above, f"{name} ({LAYERS[mine][0]}) imports {above} from a layer above it"


def test_the_layer_check_can_fail(tmp_path):
    """checkpoint importing train/ (as it once did) is caught."""
    bad = tmp_path / "checkpoint.py"
    bad.write_text("from gpt2train.train.loop import Trainer\n")
    assert imported(bad) == {"train.loop"} and layer_of("train.loop") > layer_of("checkpoint")


def test_one_file_calls_backward():
    callers = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward":
                callers.append(name)
    assert set(callers) == {"train.step"}, callers


def test_the_file_holding_fit_is_short():
    lines = (SRC / "train" / "loop.py").read_text().splitlines()
    assert any(line.strip().startswith("def fit(") for line in lines)
    assert len(lines) <= 250


@pytest.mark.parametrize("name", sorted(modules()))
def test_each_module_opens_with_its_job(name):
    docstring = ast.get_docstring(ast.parse(modules()[name].read_text()))
    assert docstring and len(docstring.split()) >= 5, f"{name}: open the module with a docstring saying its one job"
