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
    ("base", {"gpt2train", "units", "files", "process_memory", "ranges", "progress", "devices", "tokenizer", "distributed",
              "spikes", "runlog", "sections", "bench_results", "mfu_basis", "chat"}),
    ("model", {"model", "classifier", "counting", "batch_schedule", "sizing", "config", "runtime", "generation"}),
    ("data", {"data", "data.sources", "data.shards", "data.prepare", "data.prepared", "data.loader", "data.mixture",
              "data.markov", "data.pydocs", "data.conversations", "data.chat_loader", "data.chat_demo"}),
    ("storage", {"checkpoint.format", "checkpoint.state", "checkpoint.inspect", "checkpoint", "hf", "loading",
                 "gguf_export"}),
    ("eval", {"eval", "eval.val", "eval.hellaswag", "eval.likelihood", "eval.suite", "eval.harness",
              "eval.harness_tasks", "eval.run", "eval.periodic", "eval.chat"}),
    ("training", {"training", "training.optim", "training.guard", "training.step", "training.signals",
                  "training.console", "training.checkpointing", "training.runlock", "training.init_from",
                  "training.loop", "training.averaging", "training.speed", "runconfig"}),
    # What a config costs and what a run shows: they read a bench result through bench_results, never bench/.
    # chat_terminal: talking to a chat model, on top of generation.
    ("tools", {"memory", "plan", "doctor", "report", "chat_terminal"}),
    # The benchmarks measure the library from above it: nothing below imports them.
    ("bench", {"bench", "bench.journey", "bench.find_batch", "bench.generate", "bench.quality", "bench.serve",
               "bench.prepare", "bench.scaling", "bench.recipe", "bench.runs", "bench.multiplier", "bench.profile",
               "bench.chat"}),
    # serve/ needs the optional FastAPI and uvicorn: above every other layer, so only the CLI imports it
    ("serve", {"serve", "serve.request", "serve.engine", "serve.app"}),
    # the whole job: stages that are the CLI's commands, run through the CLI's main (handed in, not imported)
    ("pipeline", {"pipeline", "pipeline.definition", "pipeline.runner", "pipeline.measure", "pipeline.estimate",
                  "pipeline.card"}),
    ("cli", {"cli", "cli.pipeline", "cli.arguments", "cli.prepare", "cli.train", "cli.use", "cli.exports", "cli.evaluate",
             "cli.tools",
             "cli.bench", "cli.__main__", "__main__"}),
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
    """The package's __init__ without its library face: the PEP 562 __getattr__ imports higher layers on first
    access only (so `from gpt2train import train` works while `import gpt2train` imports nothing above it;
    test_import_gpt2train_is_cheap checks that). Every other function, and every other file, is scanned in full."""
    if path != SRC / "__init__.py":
        return tree
    tree.body = [node for node in tree.body if not (isinstance(node, ast.FunctionDef) and node.name == "__getattr__")]
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
    assert "training.loop" in imported_as_package(tmp_path, "from gpt2train.training.loop import train\n")
    assert "training.loop" in imported_as_package(tmp_path, "def helper():\n    from gpt2train.training.loop import train\n")


def imported_as_package(tmp_path: Path, text: str) -> set[str]:
    """imported() of `text` as if it were the package's __init__ (the only file the exemption covers)."""
    tree = library_face_removed(SRC / "__init__.py", ast.parse(text))
    fake = tmp_path / "__init__.py"
    fake.write_text(ast.unparse(tree))
    return imported(fake)


def face_names_taken_by_modules(root: Path) -> list[str]:
    """The library-face names (the package's __all__) that a module or subpackage of the package is named too.
    Importing such a module sets it on the package under that name, hiding the function behind __getattr__."""
    tree = ast.parse((root / "__init__.py").read_text())
    face = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets))
    children = {p.stem for p in root.glob("*.py")} | {p.parent.name for p in root.glob("*/__init__.py")}
    return sorted(set(face) & children)


def test_no_module_is_named_like_a_function_of_the_library_face(tmp_path):
    """train/ and generate.py were named like gpt2train.train and gpt2train.generate, which took swapping the
    package's class to keep the functions reachable; they are training/ and generation.py."""
    assert face_names_taken_by_modules(SRC) == []
    (tmp_path / "__init__.py").write_text('__all__ = ["generate", "train"]\n')
    (tmp_path / "generate.py").write_text("")
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "__init__.py").write_text("")
    assert face_names_taken_by_modules(tmp_path) == ["generate", "train"]  # the check can fail


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_imports_a_layer_above_it(name):
    mine = layer_of(name)
    above = sorted(dep for dep in imported(modules()[name]) if layer_of(dep) > mine)
    assert not above, f"{name} ({LAYERS[mine][0]}) imports {above} from a layer above it"


def test_the_layer_check_can_fail(tmp_path):
    """checkpoint importing training/ (as it once did) is caught."""
    bad = tmp_path / "state.py"
    bad.write_text("from gpt2train.training.loop import Trainer\n")
    assert imported(bad) == {"training.loop"} and layer_of("training.loop") > layer_of("checkpoint.state")


def test_the_layer_check_catches_a_tool_importing_the_benchmarks(tmp_path):
    """plan imported bench.journey (for a journey's MFU) and bench.memory (the estimator), doctor imported plan
    and bench.journey: bench/ sat below the commands that use it. Now they read journey.json through
    bench_results, and the estimator is gpt2train.memory."""
    bad = tmp_path / "plan.py"
    bad.write_text("from gpt2train.bench.journey import read_final_mfu\n")
    assert imported(bad) == {"bench.journey"} and layer_of("bench.journey") > layer_of("plan")
    assert all(layer_of(name) < layer_of("bench") for name in ("plan", "doctor", "report", "memory", "training.loop"))


def test_nothing_below_the_cli_imports_the_benchmarks():
    """Only bench/ itself and the CLI (which runs them) import gpt2train.bench."""
    def is_bench(name: str) -> bool:
        return name == "bench" or name.startswith("bench.")

    importers = {name for name, path in modules().items() if not is_bench(name) and any(map(is_bench, imported(path)))}
    assert importers and {name.split(".")[0] for name in importers} == {"cli"}, importers  # the cli package's modules


def test_one_file_calls_backward():
    callers = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward":
                callers.append(name)
    assert set(callers) == {"training.step"}, callers


def test_the_file_holding_fit_is_short():
    lines = (SRC / "training" / "loop.py").read_text().splitlines()
    assert any(line.strip().startswith("def fit(") for line in lines)
    assert len(lines) <= 320


@pytest.mark.parametrize("name", sorted(modules()))
def test_each_module_opens_with_its_job(name):
    docstring = ast.get_docstring(ast.parse(modules()[name].read_text()))
    assert docstring and len(docstring.split()) >= 5, f"{name}: open the module with a docstring saying its one job"


SPIKE_RULE_MODULE = "spikes.py"
STATISTICS = {"mean", "fmean", "median", "nanmean", "nanmedian", "quantile", "percentile", "std", "stdev"}


def spike_rule_owners(root: Path) -> set[str]:
    """Modules that hold a spike rule of their own: they define a spike constant (SPIKE_*) at their top level, or
    a function that speaks of spikes (an identifier with "spike" in it) takes a mean, median or spread itself,
    as the guard did (`loss > self.cfg.spike_factor * sum(self.recent) / len(self.recent)`)."""
    owners = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id.startswith("SPIKE_") for t in targets):
                owners.add(path.relative_to(root).as_posix())
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) and speaks_of_spikes(func) and takes_statistics(func):
                owners.add(path.relative_to(root).as_posix())
    return owners


def speaks_of_spikes(func: ast.AST) -> bool:
    names = [func.name] + [n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else n.arg
                           for n in ast.walk(func) if isinstance(n, (ast.Name, ast.Attribute, ast.arg))]
    return any("spike" in name.lower() for name in names)


def takes_statistics(func: ast.AST) -> bool:
    for node in ast.walk(func):
        if isinstance(node, ast.Call):
            called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if called in STATISTICS:
                return True
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.left, ast.Call) \
                and isinstance(node.left.func, ast.Name) and node.left.func.id == "sum":
            return True
    return False


def test_one_spike_rule(tmp_path):
    """The training guard, `report` and `doctor` judge spikes by spikes.py's rule alone. report and doctor had
    windows of 50 and 20, and the guard its own 3x-the-mean rule, so they could disagree on one metrics.jsonl."""
    assert spike_rule_owners(SRC) == {SPIKE_RULE_MODULE}
    (tmp_path / "doctor.py").write_text("SPIKE_WINDOW = 20\n")
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "guard.py").write_text(  # the guard's old rule
        "def observe(self, loss):\n"
        "    mean = sum(self.recent) / len(self.recent)\n"
        "    return loss > self.cfg.spike_factor * mean\n")
    (tmp_path / "report.py").write_text(  # a median of its own
        "import statistics\n\ndef is_spike(value, before):\n    return value > 2 * statistics.median(before[-50:])\n")
    (tmp_path / "plan.py").write_text(  # statistics that are no spike rule
        "import statistics\n\ndef typical_speed(speeds):\n    return statistics.median(speeds)\n")
    assert spike_rule_owners(tmp_path) == {"doctor.py", "training/guard.py", "report.py"}  # the check can fail


def shadowed_names(root: Path) -> list[str]:
    """Public top-level functions and classes a module defines under a name that a gpt2train module it imports
    defines too: two things with one name, one of them shadowing the other where both are in reach."""
    defined, imported = {}, {}
    for path in root.rglob("*.py"):
        module = ".".join(("gpt2train",) + path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        defined[module] = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                           and not node.name.startswith("_")}
        imported[module] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpt2train"):
                # `from gpt2train import devices` imports the module gpt2train.devices
                imported[module] |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return sorted(f"{module}.{name} (also {other}.{name})" for module, others in imported.items() for other in others
                  for name in defined[module] & defined.get(other, set()))


def test_no_module_shadows_a_name_of_a_module_it_imports(tmp_path):
    """plan.py had find_device, detect_device and resolve_config beside devices.py's and runtime.py's, with
    other signatures."""
    assert shadowed_names(SRC) == []
    (tmp_path / "devices.py").write_text("def find_device(name): ...\n")
    (tmp_path / "plan.py").write_text("from gpt2train import devices\n\ndef find_device(name): ...\n")
    assert shadowed_names(tmp_path) == ["gpt2train.plan.find_device (also gpt2train.devices.find_device)"]


# Private attributes of other libraries that the library still reads, each with the test that fails loudly the
# day torch moves it (a torch upgrade then names what to change, instead of a silent fallback).
PRIVATE_ALLOWED = {
    ("distributed.py", "model._orig_mod"): "tests/test_structure.py::test_torch_compile_still_wraps_as_we_unwrap",
    ("generation.py", "torch._dynamo"): "tests/test_structure.py::test_torch_compile_still_wraps_as_we_unwrap",
}


def private_attributes(root: Path) -> set[tuple[str, str]]:
    """(module, expression) for each `x._name` in the sources whose x is not self/cls/ctx: another library's
    private attribute, or our own from outside its class (`BPETokenizer(...)._with_path` is ours: allowed)."""
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "ctx"))
                    and node.attr != "_with_path"):
                found.add((path.relative_to(root).as_posix(), ast.unparse(node)))
    return found


def test_no_private_attribute_of_another_library_but_the_guarded_ones(tmp_path):
    assert private_attributes(SRC) <= set(PRIVATE_ALLOWED), private_attributes(SRC) - set(PRIVATE_ALLOWED)
    (tmp_path / "cli.py").write_text("import argparse\nargparse._SubParsersAction\n")
    assert private_attributes(tmp_path) == {("cli.py", "argparse._SubParsersAction")}  # the check can fail


def test_torch_compile_still_wraps_as_we_unwrap():
    """distributed.unwrap reads torch.compile's wrapper's `_orig_mod`; the decoder marks its KV cache static with
    torch._dynamo.mark_static_address. Neither is public: if torch changes them, this fails first."""
    import torch

    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(model)  # nothing compiles until it is called
    assert compiled._orig_mod is model, "torch.compile no longer keeps the module as _orig_mod: fix distributed.unwrap"
    assert callable(getattr(torch._dynamo, "mark_static_address", None)), \
        "torch._dynamo.mark_static_address is gone: fix generation.Decoder.compiled_step"


# --- no test hooks in the library: faults are injected from the tests (monkeypatch, a wrapper, a kill) -----
def environment_reads(tree: ast.Module) -> set[str]:
    """The names of the environment variables a module reads: `os.environ.get(X)`, `os.environ[X]`,
    `os.getenv(X)` and `X in os.environ`, with X a string or a module constant holding one."""
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}

    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute) and (
                (node.func.attr in ("get", "setdefault", "pop") and is_environ(node.func.value))
                or node.func.attr == "getenv"):
            keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            keys.append(node.left)
    names = {k.value for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return names | {constants[k.id] for k in keys if isinstance(k, ast.Name) and k.id in constants}


def hook_parameters(tree: ast.Module) -> list[str]:
    """Parameters named like a test hook (`_stop_after_shards`); a bare `_` (an unused argument) is fine."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]:
                if arg.arg.startswith("_") and arg.arg.strip("_"):
                    found.append(f"{getattr(node, 'name', 'lambda')}({arg.arg})")
    return found


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_reads_a_test_hook_from_the_environment(name):
    read = environment_reads(ast.parse(modules()[name].read_text()))
    hooks = sorted(v for v in read if "FAULT" in v.upper() or "TEST" in v.upper())
    assert not hooks, f"{name} reads {hooks}: inject faults from the tests (monkeypatch, a wrapper), not the library"


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_function_takes_a_test_hook_parameter(name):
    hooks = hook_parameters(ast.parse(modules()[name].read_text()))
    assert not hooks, f"{name}: {hooks} look like test hooks; inject the fault from the tests instead"


def test_the_test_hook_checks_can_fail():
    """The two hooks this library once had are caught."""
    old_checkpoint = ('FAULT_SLEEP_ENV = "GPT2TRAIN_FAULT_SLEEP_IN_SAVE"\n'
                      "def pause():\n    return float(os.environ.get(FAULT_SLEEP_ENV) or 0)\n")
    assert environment_reads(ast.parse(old_checkpoint)) == {"GPT2TRAIN_FAULT_SLEEP_IN_SAVE"}
    assert environment_reads(ast.parse('x = os.getenv("MY_TEST")\ny = "A_TEST" in os.environ\n')) == {"MY_TEST", "A_TEST"}
    old_prepare = "def prepare_documents(reader, *, progress=True, _stop_after_shards=None):\n    pass\n"
    assert hook_parameters(ast.parse(old_prepare)) == ["prepare_documents(_stop_after_shards)"]
    assert hook_parameters(ast.parse("f = lambda _: 0\n")) == []


# --- functions short enough to read in one screen ----------------------------------------------------------
MAX_FUNCTION_LINES = 60


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`path:line name (N lines)` for each function or method over `limit` lines, counted from its def line to
    its last line (decorators excluded), nested ones included."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_longer_than_60_lines(tmp_path):
    """estimate_memory (102 lines), run_journey (98), prepare's _prepare (88) and GPT.forward (71), among others,
    each ran several steps in one body; the steps are functions of their own, named for what they do."""
    assert long_functions(SRC) == [], f"split these where their steps have names of their own: {long_functions(SRC)}"

    def function(name: str, lines: int, indent: str = "") -> str:  # `lines` long, def line included
        return f"{indent}def {name}():\n" + f"{indent}    x = 1\n" * (lines - 1)

    (tmp_path / "memory.py").write_text(
        "class MemoryEstimate:\n    @property\n" + function("total", 60, "    ")  # 60 (and a decorator): fine
        + function("estimate_memory", 61)  # one line too many
        + "def outer():\n" + function("inner", 61, "    "))  # a nested function counts on its own
    assert long_functions(tmp_path) == ["memory.py:63 estimate_memory (61 lines)", "memory.py:124 outer (62 lines)",
                                        "memory.py:125 inner (61 lines)"]  # the check can fail
