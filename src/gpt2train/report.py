"""See a run: draw its figures and render the HTML page from templates/report.html. Nothing else.

The records come from gpt2train.runlog (which reads metrics.jsonl, merges relaunches and derives
the summary numbers); this module only draws them and writes PNG figures, a one-file HTML page and
a JSON summary. The page is described in docs/report.md.

matplotlib is imported only when figures are drawn, through its object-oriented API on the Agg
canvas: no pyplot, so a report never changes the backend or global state of the caller's process.
"""

from __future__ import annotations

import base64
import io
import math
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from gpt2train import runlog
from gpt2train.files import write_json_atomic, write_text_atomic
from gpt2train.runlog import Run
from gpt2train.spikes import SPIKE_RULE
from gpt2train.units import format_bytes, format_count, format_duration, format_utc


class ReportError(ValueError):
    """A report that cannot be made for a reason of its own (no run given, no matplotlib); one line.

    A run log that cannot be read raises runlog.RunLogError instead.
    """


# ----------------------------------------------------------------------------------------------
# Figures


@dataclass
class Chart:
    name: str  # file stem: loss -> loss.png
    title: str
    figure: object | None  # a matplotlib Figure, or None when there is nothing to draw
    notes: list[str] = field(default_factory=list)  # what is missing, shown under the figure


def _matplotlib() -> types.SimpleNamespace:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise ReportError("the report draws with matplotlib, which is not installed: pip install matplotlib") from None
    return types.SimpleNamespace(Figure=Figure, FigureCanvasAgg=FigureCanvasAgg, Line2D=Line2D,
                                 FuncFormatter=FuncFormatter)


def _new_axes():
    mpl = _matplotlib()
    # Constrained layout makes room for labels and the outside legend, so nothing overlaps.
    fig = mpl.Figure(figsize=(10, 3.6), layout="constrained")
    mpl.FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("step")
    return fig, ax


def _legend(fig, runs: list[Run], extra: list = ()) -> None:
    """One entry per run (its colour), then entries for line styles and markers."""
    Line2D = _matplotlib().Line2D
    handles = [Line2D([], [], color=_colour(i), lw=2, label=run.name) for i, run in enumerate(runs)] + list(extra)
    # Above the axes, not beside them: every figure then has the same plot width, so steps line up
    # from one figure to the next.
    fig.legend(handles=handles, loc="outside upper center", ncols=min(len(handles), 5), fontsize="small",
               frameon=False)


def _log_y(ax) -> None:
    """A log y axis labelled 0.5, 1, 2, 5 rather than 5x10^-1: read at a glance."""

    def label(y, _):
        mantissa = y / 10 ** math.floor(math.log10(y) + 1e-9) if y > 0 else 0
        return f"{y:g}" if round(mantissa) in (1, 2, 5) else ""

    ax.set_yscale("log")
    for axis_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis_formatter(_matplotlib().FuncFormatter(label))


def _colour(i: int) -> str:
    return f"C{i % 10}"


def _xy(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if runlog.is_finite(r.get(key))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _missing(runs: list[Run], what: str, has) -> list[str]:
    """A note naming the runs that lack a series, when only some of them do."""
    lacking = [run.name for run in runs if not has(run)]
    return [f"No {what} in {', '.join(lacking)}."] if lacking and len(lacking) < len(runs) else []


SOURCE_MARKERS = ("s", "^", "v", "D", "P", "X")


def _source_names(runs: list[Run]) -> list[str]:
    """The sources of the runs' mixtures (data.sources), in the order first logged."""
    names = {}
    for run in runs:
        for r in run.of("val"):
            if isinstance(r.get("sources"), dict):
                names.update(dict.fromkeys(map(str, r["sources"])))
    return list(names)


def _source_records(run: Run, name: str) -> list[dict]:
    """One source's val records of a mixture, shaped like the overall ones (step, val_loss)."""
    return [{"step": r.get("step"), **r["sources"][name]} for r in run.of("val")
            if isinstance(r.get("sources"), dict) and isinstance(r["sources"].get(name), dict)]


def _loss_chart(runs: list[Run], log_y: bool) -> Chart:
    title = "Loss"

    def has_train(run):
        return bool(_xy(run.of("train"), "loss")[0])

    def has_val(run):
        return bool(_xy(run.of("val"), "val_loss")[0])

    if not any(has_train(r) or has_val(r) for r in runs):
        return Chart("loss", title, None, ["Loss not drawn: no train or val records with a finite loss yet."])
    Line2D = _matplotlib().Line2D
    fig, ax = _new_axes()
    for i, run in enumerate(runs):
        ax.plot(*_xy(run.of("train"), "loss"), color=_colour(i), lw=1, alpha=0.8)
        ax.plot(*_xy(run.of("val"), "val_loss"), color=_colour(i), lw=1.5, ls="--", marker="o", ms=4)
        for j, name in enumerate(_source_names([run])):  # a mixture's sources: dotted, a marker each
            ax.plot(*_xy(_source_records(run, name), "val_loss"), color=_colour(i), lw=1, ls=":",
                    marker=SOURCE_MARKERS[j % len(SOURCE_MARKERS)], ms=4)
        for start in run.of("run_start")[1:]:  # resumes: where a new launch took over
            if runlog.is_int(start.get("step")):
                ax.axvline(start["step"], color=_colour(i), lw=1, ls="-.", alpha=0.6)
    ax.set_ylabel("loss")
    if log_y:
        _log_y(ax)
    styles = [Line2D([], [], color="grey", lw=1, label="train")]
    if any(has_val(r) for r in runs):
        styles.append(Line2D([], [], color="grey", lw=1.5, ls="--", marker="o", ms=4, label="val"))
    for j, name in enumerate(_source_names(runs)):
        styles.append(Line2D([], [], color="grey", lw=1, ls=":", marker=SOURCE_MARKERS[j % len(SOURCE_MARKERS)], ms=4,
                             label=f"val {name}"))
    if any(len(run.of("run_start")) > 1 for run in runs):
        styles.append(Line2D([], [], color="grey", lw=1, ls="-.", label="resume"))
    _legend(fig, runs, styles)
    notes = _missing(runs, "train records", has_train) + _missing(runs, "val records", has_val)
    if not any(has_val(r) for r in runs):
        if any(r.of("val") for r in runs):  # there are some: NaN or inf, which no chart can draw
            notes.append("No val loss drawn: every val record holds NaN or inf (the run diverged; "
                         "`gpt2train doctor RUN_DIR` says where).")
        else:
            notes.append("No val records yet: validation runs every eval.interval steps and at the end.")
    return Chart("loss", title, fig, notes)


def _grad_norm_chart(runs: list[Run]) -> Chart:
    title = "Gradient norm before clipping"
    if not any(_xy(run.of("train"), "grad_norm")[0] for run in runs):
        return Chart("grad_norm", title, None, [f"{title} not drawn: no train records with grad_norm yet."])
    Line2D = _matplotlib().Line2D
    fig, ax = _new_axes()
    all_positive, any_spike, actions = True, False, set()
    for i, run in enumerate(runs):
        steps, norms = _xy(run.of("train"), "grad_norm")
        all_positive &= all(n > 0 for n in norms)
        ax.plot(steps, norms, color=_colour(i), lw=1)
        spikes = runlog.find_spikes(norms)
        any_spike |= bool(spikes)
        ax.plot([steps[j] for j in spikes], [norms[j] for j in spikes], ls="none", marker="x", ms=9, mew=2, color="red")
        for g in run.of("guard"):
            if runlog.is_int(g.get("step")):
                actions.add(g.get("action"))
                ax.axvline(g["step"], color=_colour(i), lw=1.2, ls=_guard_style(g.get("action")))
    clips = {runlog.config_value(runlog.object_field(start, "config"), "train", "grad_clip")
             for run in runs for start in run.of("run_start")}
    clips = sorted(c for c in clips if runlog.is_finite(c) and c > 0)
    for clip in clips:
        ax.axhline(clip, color="black", lw=0.8, alpha=0.5)
    if all_positive:
        _log_y(ax)  # early norms and spikes are orders of magnitude above the steady state
    ax.set_ylabel("grad norm")
    extra = []  # legend entries only for what the figure shows
    if any_spike:
        extra.append(Line2D([], [], ls="none", marker="x", ms=9, mew=2, color="red",
                            label=f"spike ({SPIKE_RULE})"))
    for action in sorted(actions, key=str):
        extra.append(Line2D([], [], color="grey", lw=1.2, ls=_guard_style(action), label=f"guard: {action}"))
    if clips:
        extra.append(Line2D([], [], color="black", lw=0.8, alpha=0.5, label="clip threshold"))
    _legend(fig, runs, extra)
    return Chart("grad_norm", title, fig)


def _guard_style(action) -> str:
    return {"skip": ":", "rollback": "--"}.get(action, "-.")


def _series_chart(runs: list[Run], name: str, title: str, kind: str, key: str, ylabel: str, why_absent: str,
                  scale: float = 1.0, skip_compile_step: bool = False) -> Chart:
    """A figure of one field of one kind against step, one line per run."""

    def points(run):
        records = run.of(kind)
        if skip_compile_step:  # its time includes compilation and would squash the axis
            records = [r for r in records if not r.get("compile_ms")]
        steps, values = _xy(records, key)
        return steps, [v * scale for v in values]

    if not any(points(run)[0] for run in runs):
        return Chart(name, title, None, [f"{title} not drawn: {why_absent}"])
    fig, ax = _new_axes()
    top = 0.0
    for i, run in enumerate(runs):
        steps, values = points(run)
        ax.plot(steps, values, color=_colour(i), lw=1)
        top = max([top, *values])
    ax.set_ylabel(ylabel)
    # From zero: rates and sizes read wrong on an axis cut short. Headroom: a steady line is not
    # drawn on the frame.
    ax.set_ylim(0, top * 1.1 or 1.0)
    if name != "lr":  # 1,300,000 tokens/s, not 1.3 under a "1e6" in the corner
        plain = _matplotlib().FuncFormatter(lambda y, _: f"{y:,.0f}" if y >= 100 else f"{y:g}")
        ax.yaxis.set_major_formatter(plain)
    _legend(fig, runs)
    return Chart(name, title, fig, _missing(runs, key, lambda run: bool(points(run)[0])))


def _hellaswag_chart(runs: list[Run]) -> Chart | None:
    if not any(run.of("hellaswag") for run in runs):
        return None  # optional during training; its absence needs no note
    Line2D = _matplotlib().Line2D
    fig, ax = _new_axes()
    for i, run in enumerate(runs):
        ax.plot(*_xy(run.of("hellaswag"), "acc_norm"), color=_colour(i), lw=1.5, marker="o", ms=4)
        ax.plot(*_xy(run.of("hellaswag"), "acc"), color=_colour(i), lw=1, ls="--", alpha=0.7)
    ax.axhline(0.25, color="black", lw=0.8, alpha=0.5)  # four endings: chance
    ax.set_ylabel("accuracy")
    styles = [
        Line2D([], [], color="grey", lw=1.5, marker="o", ms=4, label="acc_norm"),
        Line2D([], [], color="grey", lw=1, ls="--", label="acc"),
        Line2D([], [], color="black", lw=0.8, alpha=0.5, label="chance (0.25)"),
    ]
    _legend(fig, runs, styles)
    sources = [f"{run.name}: {', '.join(named)}" for run in runs  # absent from logs written before it was recorded
               if (named := list(dict.fromkeys(r["source"] for r in run.of("hellaswag") if r.get("source"))))]
    return Chart("hellaswag", "HellaSwag accuracy", fig, [f"HellaSwag's examples: {'; '.join(sources)}."] if sources else [])


def _suite_chart(runs: list[Run]) -> Chart | None:
    """The mean centered accuracy over the tasks (bold) and each task's (thin) against tokens. One run: a colour
    per task, named in the legend. Several: a colour per run, the tasks unnamed (ten names per run would not read)."""
    if not any(run.of("suite") for run in runs):
        return None  # optional during training (eval.tasks); its absence needs no note
    Line2D = _matplotlib().Line2D
    fig, ax = _new_axes()
    ax.set_xlabel("tokens")  # runs with other batches compare at the same data seen
    ax.xaxis.set_major_formatter(_matplotlib().FuncFormatter(lambda x, _: format_count(x)))  # 1.50B, not 1.5 x 1e9
    one = len(runs) == 1
    styles = []
    for i, run in enumerate(runs):
        records = [{**r, "step": r["tokens"]} for r in run.of("suite") if runlog.is_int(r.get("tokens"))]
        for j, name in enumerate(_task_names(records)):
            task = [{"step": r["step"], **r["tasks"][name]} for r in records
                    if isinstance(r.get("tasks"), dict) and isinstance(r["tasks"].get(name), dict)]
            style = {"color": _colour(j), "ls": "-" if j < 10 else "--", "lw": 1} if one else \
                {"color": _colour(i), "lw": 0.8, "alpha": 0.4}
            ax.plot(*_xy(task, "centered"), **style)
            if one:
                styles.append(Line2D([], [], **style, label=name))
        ax.plot(*_xy(records, "centered_mean"), color="black" if one else _colour(i), lw=2.2, marker="o", ms=4)
    ax.axhline(0.0, color="grey", lw=0.8, ls=":")
    ax.set_ylabel("centered accuracy")
    styles = [Line2D([], [], color="black" if one else "grey", lw=2.2, marker="o", ms=4, label="mean"), *styles]
    if not one:
        styles.append(Line2D([], [], color="grey", lw=0.8, alpha=0.4, label="one task"))
    styles.append(Line2D([], [], color="grey", lw=0.8, ls=":", label="chance (0)"))
    if one:  # the run is the page's title; the colours are the tasks'
        fig.legend(handles=styles, loc="outside upper center", ncols=min(len(styles), 6), fontsize="small", frameon=False)
    else:
        _legend(fig, runs, styles)
    notes = ["Centered accuracy: (accuracy - chance) / (1 - chance) of each task, 0 at chance and 1 when every "
             "example is right."]
    if not one:
        notes.append("Each task of each run is a thin line in the run's colour; a report of one run names them.")
    return Chart("suite", "Multiple-choice suite (centered accuracy)", fig,
                 notes + _missing(runs, "suite records", lambda run: bool(run.of("suite"))))


def _task_names(records: list[dict]) -> list[str]:
    """The tasks of a run's suite records, in the order first logged."""
    names = {}
    for r in records:
        if isinstance(r.get("tasks"), dict):
            names.update(dict.fromkeys(map(str, r["tasks"])))
    return list(names)


def _charts(runs: list[Run], log_y: bool = False) -> list[Chart]:
    charts = [
        _loss_chart(runs, log_y),
        _series_chart(runs, "lr", "Learning rate", "train", "lr", "learning rate", "no train records yet."),
        _grad_norm_chart(runs),
        _series_chart(runs, "tokens_per_s", "Throughput", "train", "tokens_per_s", "tokens / s",
                      "no train records with tokens_per_s yet.", skip_compile_step=True),
        _series_chart(runs, "mfu", "MFU", "train", "mfu", "MFU (%)",
                      "MFU is null when no peak FLOP/s is known for the device (MPS, a GPU not in the table, a CPU "
                      "run logged before the trainer measured its matmul ceiling).",
                      scale=100.0, skip_compile_step=True),
        _series_chart(runs, "memory", "Peak memory", "train", "peak_mem_mb", "peak memory (GiB)",
                      "peak memory is only measured on CUDA devices.", scale=1 / 1024),
        _hellaswag_chart(runs),
        _suite_chart(runs),
    ]
    return [c for c in charts if c is not None]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------
# The report


def build_report(run_dirs: list[Path], out_dir: Path | None = None, *, log_y: bool = False) -> Path:
    """Write PNG figures, report.html and metrics.json for one or more runs; return report.html's path.

    out_dir defaults to RUN_DIR/report for one run and ./report for several (overlaid for comparison).
    """
    if isinstance(run_dirs, (str, Path)):  # one run passed bare: not a list of its characters
        run_dirs = [run_dirs]
    if not run_dirs:
        raise ReportError("no run directory given: pass at least one RUN_DIR")
    runs = [runlog.load_run(d, name) for d, name in zip(run_dirs, _run_names(run_dirs))]
    if out_dir is None:
        out_dir = Path(run_dirs[0]) / "report" if len(runs) == 1 else Path("report")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    images = {}
    charts = _charts(runs, log_y)
    for chart in charts:
        png_path = out_dir / f"{chart.name}.png"
        if chart.figure is None:
            png_path.unlink(missing_ok=True)  # a figure from an earlier report would no longer match the page
            continue
        images[chart.name] = _png(chart.figure)
        png_path.write_bytes(images[chart.name])

    summaries = [runlog.summarize(run) for run in runs]
    write_json_atomic(out_dir / "metrics.json", {"runs": [_json_safe(s) for s in summaries]})
    html_path = out_dir / "report.html"
    write_text_atomic(html_path, _page(runs, summaries, charts, images))  # a reload mid-run sees a whole page
    return html_path


def _run_names(run_dirs: list[Path]) -> list[str]:
    """Folder names, with the parent prepended where two runs share one (a/run1, b/run1)."""
    paths = [Path(d).resolve() for d in run_dirs]
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]


def _json_safe(summary: dict) -> dict:
    # Strict JSON has no NaN or Infinity; a diverged run's loss becomes null.
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}


# ----------------------------------------------------------------------------------------------
# HTML

# (label, summary key, format): the rows of the summary table, one column per run. A pair of keys is
# formatted together: (what ran, what was asked).
SUMMARY_ROWS = [
    ("status", "status", str),
    ("steps", "steps", lambda v: f"{v:,}"),
    ("tokens seen", "tokens", lambda v: f"{v:,}"),
    ("wall time", "wall_s", format_duration),
    ("best val loss", "best_val_loss", lambda v: f"{v:.4f}"),
    ("bits/byte at best val", "best_val_bpb", lambda v: f"{v:.4f}"),
    ("best val step", "best_val_step", lambda v: f"{v:,}"),
    ("val loss per source at best val", "best_val_sources", lambda v: "; ".join(  # a mixture's (data.sources)
        f"{name} {_format(each['val_loss'], lambda x: f'{x:.4f}')}" for name, each in v.items())),
    ("last train loss", "last_train_loss", lambda v: f"{v:.4f}"),
    ("suite centered mean (last)", "suite_centered_mean", lambda v: f"{v:.4f}"),  # eval.tasks
    ("suite step (last)", "suite_step", lambda v: f"{v:,}"),
    ("mean tokens/s", "mean_tokens_per_s", lambda v: f"{v:,.0f}"),
    ("mean MFU", "mean_mfu", lambda v: f"{100 * v:.1f}%"),
    ("peak memory", "peak_mem_mb", lambda v: format_bytes(v * 2**20)),
    ("parameters", "params", lambda v: f"{v:,}"),
    ("n_layer / n_head / n_embd", None, None),  # filled from three keys in _summary_table
    ("micro_batch", "micro_batch", str),
    ("seq_len", "seq_len", str),
    ("lr", "lr", lambda v: f"{v:g}"),
    ("schedule", "schedule", str),
    ("dtype", ("dtype_ran", "dtype"), runlog.ran_and_asked),  # what ran, and what the config asked where it differs
    ("compile", ("compile_ran", "compile"), runlog.ran_and_asked),
    ("device", ("device_name", "device_asked"), runlog.ran_and_asked),
    ("torch", "torch", str),
    ("world size", "world_size", str),
    ("git revision", "git", str),
    ("launches", "launches", str),
    ("guard events", "guard_events", str),
    ("malformed lines skipped", "malformed_lines", str),
]


ONLY_WHEN_PRESENT = {"best_val_sources", "suite_centered_mean", "suite_step"}  # rows left out where no run has them


def _page(runs: list[Run], summaries: list[dict], charts: list[Chart], images: dict[str, bytes]) -> str:
    """templates/report.html rendered by jinja2 with autoescape on: the template holds all the markup, and
    every value handed to it here is plain text (or base64) that jinja2 escapes."""
    generated = format_utc(time.time())
    return _template().render(
        names=", ".join(run.name for run in runs),
        states="; ".join(f"{summary['run']}: {_state(summary)}" for summary in summaries),
        generated=generated,
        read_notes=_read_notes(runs),
        summary=_summary_table(summaries),
        figures=[_figure(chart, images.get(chart.name)) for chart in charts],
        events=_events(runs),
        samples=_samples(runs),
    )


def _state(summary: dict) -> str:
    """Where a run stands, for the page's subtitle: finished, stopped, failed, or in progress (the page then
    holds what metrics.jsonl held when it was built)."""
    at = f" at step {summary['steps']:,}" if summary["steps"] is not None else ""
    status = summary["status"]
    if status == "done":
        return f"finished{at}"
    if status == "signal":
        return f"stopped by a signal{at} (continue it with --resume auto)"
    if status == "error":
        return f"ended by an error{at}"
    if status.startswith("in progress"):
        return f"in progress{at} (or killed: no run_end record yet): this page shows what its metrics.jsonl held when built"
    return f"{status}{at}"


def _template() -> jinja2.Template:
    # A package loader finds the template in a wheel install as well as in a source checkout.
    env = jinja2.Environment(loader=jinja2.PackageLoader("gpt2train", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    return env.get_template("report.html")


def _figure(chart: Chart, png: bytes | None) -> dict:
    """A chart's title, its PNG as base64 (None when not drawn) and its notes."""
    data = base64.b64encode(png).decode("ascii") if png is not None else None
    return {"title": chart.title, "png_base64": data, "notes": chart.notes}


def _read_notes(runs: list[Run]) -> list[str]:
    notes = []
    for run in runs:
        if run.malformed_lines:
            notes.append(f"{run.name}: skipped {run.malformed_lines} malformed line(s) in {runlog.METRICS_FILE}.")
        if run.truncated_last_line:
            notes.append(f"{run.name}: the last line of {runlog.METRICS_FILE} is incomplete "
                         "(a crash, or a write in progress).")
    return notes


def _summary_table(summaries: list[dict]) -> dict:
    """{"runs": the column heads, "rows": (label, one text per run)} for the summary table."""
    rows = []
    for label, key, fmt in SUMMARY_ROWS:
        if key in ONLY_WHEN_PRESENT and all(s.get(key) is None for s in summaries):
            continue
        cells = []
        for s in summaries:
            if key is None:
                text = " / ".join("?" if s[k] is None else str(s[k]) for k in ("n_layer", "n_head", "n_embd"))
            elif isinstance(key, tuple):
                text = fmt(*(s[k] for k in key))
            else:
                text = _format(s[key], fmt)
            cells.append(text)
        rows.append((label, cells))
    return {"runs": [s["run"] for s in summaries], "rows": rows}


def _format(value, fmt) -> str:
    if value is None:
        return "-"
    try:
        return fmt(value)  # a diverged loss shows as nan
    except (TypeError, ValueError):  # a field of an unexpected type: show it as it is
        return str(value)


def _events(runs: list[Run]) -> list[dict]:
    """The resumes and guard actions of every run, by run and step."""
    rows = []
    for run in runs:
        for i, rec in enumerate(run.of("run_start")):
            if i == 0 and not rec.get("resumed_from"):
                continue  # the first launch is not a resume
            where = f"from {rec.get('resumed_from') or '?'}"
            rows.append((run.name, rec.get("step"), "resume", where, rec.get("time")))
        for rec in run.of("guard"):
            detail = f"{rec.get('reason', '')}; loss {_num(rec.get('loss'))}, grad norm {_num(rec.get('grad_norm'))}"
            if rec.get("action") == "rollback":
                detail += f"; back to step {rec.get('to_step', '?')}"
            rows.append((run.name, rec.get("step"), f"guard: {rec.get('action', '?')}", detail, rec.get("time")))
    rows.sort(key=lambda r: (r[0], r[1] if runlog.is_int(r[1]) else -1))
    return [{"run": name, "step": str(step), "what": what, "detail": detail, "when": _when(t)}
            for name, step, what, detail, t in rows]


def _samples(runs: list[Run]) -> list[dict]:
    """Each run's latest sample record; text None when it has none."""
    parts = []
    for run in runs:
        samples = run.of("sample")
        if not samples:
            parts.append({"run": run.name, "text": None})
            continue
        s = samples[-1]
        # repr: a prompt of "\n" stays visible
        parts.append({"run": run.name, "step": s["step"], "prompt": repr(s.get("prompt", "")),
                      "text": str(s.get("text", ""))})
    return parts


def _num(x) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "?"


def _when(t) -> str:
    if not runlog.is_finite(t):
        return ""
    return format_utc(t)
