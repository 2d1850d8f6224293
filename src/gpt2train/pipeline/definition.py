"""What a pipeline is: named stages in order, each one gpt2train command line (the command's own config and
arguments), read from a TOML file or a preset (configs/pipelines/). What a stage reads and writes is what its
arguments say; every mistake in them is found here, before any stage runs, and said in one line naming the
stage and the key.

    [pipeline]
    out = "runs/pipeline-cpu"                 # {out} in a command; `pipeline --out` moves it

    [stage.data]
    run = "prepare shakespeare --out {out}/data"

    [stage.pretrain]
    run = "train --config shakespeare-cpu --set data.dir={out}/data --out {out}/base"
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import io
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from gpt2train.ranges import UsageError

# The commands a stage may run: each makes something the next stages read. (sample, chat and serve use a model
# and end only when asked; bench, plan and doctor make no input of another stage.)
STAGE_COMMANDS = ("prepare", "tokenizer", "train", "eval", "export-hf", "export-gguf")
PIPELINE_KEYS = {"description", "out"}
STAGE_KEYS = {"run"}


class PipelineError(UsageError):
    """A pipeline that cannot run as written; one line naming the stage and key (exit status 2)."""


@dataclass
class Stage:
    name: str
    argv: list[str]  # the command's arguments, {out} filled in and --set applied
    args: argparse.Namespace  # as gpt2train's parser reads them
    writes: Path | None  # the folder or file it makes (None: eval, which writes eval.json into its checkpoint)
    reads: list[Path] = field(default_factory=list)  # the paths its arguments name that it reads
    after: list[str] = field(default_factory=list)  # the earlier stages whose outputs it reads

    @property
    def command(self) -> str:
        """The command as its name reads: "prepare shakespeare", "train", "export-hf" ..."""
        return " ".join(self.argv[:2] if self.argv[0] in ("prepare", "tokenizer") else self.argv[:1])

    @property
    def line(self) -> str:
        return shlex.join(["gpt2train", *self.argv])


@dataclass
class Pipeline:
    name: str  # the preset's or the file's
    description: str
    out: Path
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)


def pipeline_presets() -> dict:
    """Pipeline preset name -> its TOML inside the installed package."""
    folder = importlib.resources.files("gpt2train") / "configs" / "pipelines"
    return {f.name.removesuffix(".toml"): f for f in sorted(folder.iterdir(), key=lambda f: f.name)
            if f.name.endswith(".toml")}


def read_pipeline_text(source: str) -> tuple[str, str]:
    """(its name, its TOML) of a pipeline file, else of the preset of that name."""
    if Path(source).is_file():
        return Path(source).stem, Path(source).read_text(encoding="utf-8")
    presets = pipeline_presets()
    if source in presets:
        return source, presets[source].read_text(encoding="utf-8")
    raise PipelineError(f"pipeline {source} is neither a file nor a preset; presets are {', '.join(presets)}")


def load_pipeline(source: str, parser: argparse.ArgumentParser, out: str | None = None,
                  overrides: list[str] = ()) -> Pipeline:
    """The pipeline of a file or preset, its stages' commands read by gpt2train's `parser`; out: its output
    folder (default the file's [pipeline] out); overrides: `STAGE.KEY=VALUE` (a config key of a train stage,
    `pretrain.train.max_steps=50`, else one of the command's flags, `data.val-fraction=0.2`)."""
    name, text = read_pipeline_text(source)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PipelineError(f"{name}: invalid TOML: {e}") from None
    head, stages = data.pop("pipeline", {}), data.pop("stage", {})
    if not isinstance(head, dict) or not isinstance(stages, dict) or not all(isinstance(t, dict) for t in stages.values()):
        raise PipelineError(f"{name}: [pipeline] and each [stage.NAME] must be tables (a stage: run = \"COMMAND ...\")")
    unknown(data, {"pipeline", "stage"}, f"{name}: unknown table")
    unknown(head, PIPELINE_KEYS, f"{name}: [pipeline] has an unknown key")
    if not stages:
        raise PipelineError(f"{name}: no stage; add [stage.NAME] tables with run = \"COMMAND ...\"")
    folder = Path(out or head.get("out") or Path("runs") / name)
    commands = {}
    for stage_name, table in stages.items():
        unknown(table, STAGE_KEYS, f"{name}: [stage.{stage_name}] has an unknown key")
        if not isinstance(table.get("run"), str):
            raise PipelineError(f"{name}: [stage.{stage_name}] needs run = \"COMMAND ...\" (a gpt2train command)")
        commands[stage_name] = shlex.split(table["run"].replace("{out}", shlex.quote(str(folder))))
    for item in overrides:
        set_stage_flag(commands, item)
    built = [parse_stage(stage_name, argv, parser, folder) for stage_name, argv in commands.items()]
    pipeline = Pipeline(name, head.get("description", ""), folder, built)
    check_order(pipeline)
    check_conflicts(pipeline)
    return pipeline


def unknown(table: dict, allowed: set[str], what: str) -> None:
    extra = sorted(set(table) - allowed)
    if extra:
        raise PipelineError(f"{what} {extra[0]!r}; it takes {', '.join(sorted(allowed))}")


def set_stage_flag(commands: dict[str, list[str]], item: str) -> None:
    """`STAGE.KEY=VALUE` into that stage's command: --set KEY=VALUE for a train stage's config key (it has a dot),
    else --KEY VALUE, in place of the flag's value where the command has it."""
    target, eq, value = item.partition("=")
    stage, dot, key = target.partition(".")
    if not (eq and dot and key):
        raise PipelineError(f"--set {item!r}: expected STAGE.KEY=VALUE (pretrain.train.max_steps=50, data.val-fraction=0.2)")
    if stage not in commands:
        raise PipelineError(f"--set {item!r}: no stage {stage!r}; stages are {', '.join(commands)}")
    argv = commands[stage]
    if "." in key:
        if argv[0] != "train":
            raise PipelineError(f"--set {item!r}: stage {stage} runs `{argv[0]}`, which has no config keys; give "
                                f"one of its flags ({stage}.FLAG=VALUE)")
        argv += ["--set", f"{key}={value}"]
        return
    flag = "--" + key.replace("_", "-")
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]


def parse_stage(name: str, argv: list[str], parser: argparse.ArgumentParser, out: Path) -> Stage:
    """The stage's command read by gpt2train's own parser (its one-line usage error, said for the stage), and
    what it reads and writes."""
    if not argv or argv[0] not in STAGE_COMMANDS:
        given = argv[0] if argv else "nothing"
        raise PipelineError(f"stage {name}: runs {given!r}; a stage runs one of {', '.join(STAGE_COMMANDS)}")
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            args = parser.parse_args(argv)
    except SystemExit:
        message = said.getvalue().strip().splitlines()[-1].removeprefix("error: ") if said.getvalue().strip() else ""
        raise PipelineError(f"stage {name}: {message}") from None
    if argv[0] == "train":
        if args.out is None:
            raise PipelineError(f"stage {name}: give the run directory, --out {{out}}/NAME")
        if args.resume is None:  # an interrupted stage continues inside itself: training's exact resume
            argv = [*argv, "--resume", "auto"]
            args.resume = "auto"
    reads, writes = paths_of(name, argv[0], args, out)
    return Stage(name, argv, args, writes, reads)


def paths_of(name: str, command: str, args: argparse.Namespace, out: Path) -> tuple[list[Path], Path | None]:
    """(what the stage reads, what it writes), from its arguments."""
    if command == "train":
        return train_reads(name, args, out), Path(args.out)
    if command == "eval":
        return [Path(args.ckpt), *([Path(args.data)] if args.data else [])], None
    if command in ("export-hf", "export-gguf"):
        return [Path(args.ckpt)], Path(args.out)
    reads = [Path(p) for p in getattr(args, "paths", None) or []]
    tokenizer = getattr(args, "tokenizer", None) or ""
    if tokenizer.startswith("bpe:"):
        reads.append(Path(tokenizer.removeprefix("bpe:")))
    hf = getattr(args, "hf", None)
    if hf and Path(hf).exists():  # a local dataset folder (a Hub name is read from the Hub)
        reads.append(Path(hf))
    return reads, Path(args.out)


def train_reads(name: str, args: argparse.Namespace, out: Path) -> list[Path]:
    """A train stage's data folders and its init_from, from its config and --set (as written, not resolved:
    resolving reads the data and the source, which earlier stages may not have made yet). An init_from that is
    neither there nor in the pipeline's folder is a Hub name, for train to fetch."""
    from gpt2train.config import ConfigError, data_sources, load_config
    from gpt2train.training import init_from

    try:
        cfg = load_config(args.config, args.set or [])
    except ConfigError as e:
        raise PipelineError(f"stage {name}: {e}") from None
    reads = [Path(folder) for folder, _ in data_sources(cfg.data)]
    source = cfg.train.init_from
    if not init_from.is_scratch(source) and (Path(source).exists() or inside(Path(source), out)):
        reads.append(Path(source))
    return reads


def check_order(pipeline: Pipeline) -> None:
    """Every path a stage reads is made by a stage before it, or is there already; no two stages write the same
    path. A path made only by a later stage is a stage out of order."""
    writers: dict[Path, str] = {}
    for i, stage in enumerate(pipeline.stages):
        for read in stage.reads:
            maker = made_by(read, writers)
            if maker is not None:
                stage.after.append(maker)
                continue
            later = next((s.name for s in pipeline.stages[i + 1:] if s.writes and inside(read, s.writes)), None)
            if later is not None:
                raise PipelineError(f"stage {stage.name} reads {read}, which stage {later} makes after it; put "
                                    f"{later} first")
            if not read.exists():
                raise PipelineError(f"stage {stage.name} reads {read}, which does not exist and no stage before "
                                    "it makes")
        if stage.writes is not None:
            taken = made_by(stage.writes, writers) or next(
                (n for path, n in writers.items() if inside(path, stage.writes)), None)
            if taken is not None:
                raise PipelineError(f"stages {taken} and {stage.name} both write {stage.writes}; give {stage.name} "
                                    "another --out")
            writers[stage.writes] = stage.name


def made_by(path: Path, writers: dict[Path, str]) -> str | None:
    return next((name for written, name in writers.items() if inside(path, written)), None)


def inside(path: Path, folder: Path) -> bool:
    """Whether path is folder or within it (as absolute paths)."""
    path, folder = path.absolute(), folder.absolute()
    return path == folder or folder in path.parents


def check_conflicts(pipeline: Pipeline) -> None:
    """Settings of one stage that another cannot take, found before any runs: a model exported to a format that
    cannot hold its recipe; a fine-tune whose data's tokenizer is not its source's."""
    from gpt2train.config import load_config

    for stage in pipeline.stages:
        sources = [pipeline.stage(name) for name in stage.after]
        trained = [s for s in sources if s.argv[0] == "train"]
        if stage.argv[0] in ("export-hf", "export-gguf") and trained:
            model = load_config(trained[0].args.config, trained[0].args.set or []).model
            try:
                exportable(stage.argv[0], model)
            except ValueError as e:
                raise PipelineError(f"stage {stage.name} exports stage {trained[0].name}'s model: {e}; remove the "
                                    "stage, or train that model with GPT-2's recipe") from None
        if stage.argv[0] == "train" and trained:
            data = [s for s in sources if s.argv[0] == "prepare"]
            source_data = [pipeline.stage(n) for n in trained[0].after if pipeline.stage(n).argv[0] == "prepare"]
            if data and source_data and tokenizer_of(data[0]) != tokenizer_of(source_data[0]):
                raise PipelineError(f"stage {stage.name} fine-tunes stage {trained[0].name}'s model (tokenizer "
                                    f"{tokenizer_of(source_data[0])}, stage {source_data[0].name}) on stage "
                                    f"{data[0].name}'s data (tokenizer {tokenizer_of(data[0])}); prepare both with "
                                    "one --tokenizer")


def exportable(command: str, model) -> None:
    """The exporter's own refusal of a model it cannot hold (ValueError), checked on the config alone."""
    if command == "export-hf":
        from gpt2train.hf import check_exportable
    else:
        from gpt2train.gguf_export import check_exportable
    check_exportable(model)


def tokenizer_of(stage: Stage) -> str:
    """A prepare stage's --tokenizer (gpt2 by default; markov's is char, pydocs' its own BPE)."""
    default = {"prepare markov": "char", "prepare pydocs": "bpe"}.get(stage.command, "gpt2")
    return getattr(stage.args, "tokenizer", None) or default
