"""The report card a pipeline ends with: each stage's time and what it measured, the machine, the commit and the
pipeline, what each number means and what beats it, and the chat model answering held-out conversations; as
Markdown (OUT/report.md) and as a page in the HTML report's style (OUT/report.html)."""

from __future__ import annotations

import html
import platform
import subprocess
import time
from pathlib import Path

from gpt2train.files import write_text_atomic
from gpt2train.pipeline.definition import Pipeline
from gpt2train.pipeline.runner import Outcome
from gpt2train.units import format_bytes, format_count, format_duration

MEANINGS = [
    ("val loss", "the mean cross-entropy (nats per token) on held-out text the model never trained on; lower is "
     "better. It compares runs with the same tokenizer and data only. What beats it: more tokens or a larger model "
     "(`model.depth`), the modern recipe (docs/benchmarks.md)."),
    ("bits per byte", "the same loss per byte of text, whatever the tokenizer: compares runs across tokenizers "
     "and data sets; lower is better."),
    ("centered accuracy", "a suite task's accuracy rescaled so that chance is 0 and every answer right is 1 "
     "(CORE's rule); the CORE mean averages the ten. Compare means over the same tasks, --limit and seed only. "
     "What beats it: nanochat reports 0.1139 for GPT-2 124M on DCLM's 22-task CORE (docs/eval.md); a model of "
     "the quickstart's size scores near 0."),
    ("exact match", "the share of held-out conversations whose greedy reply is the reference word for word; "
     "chance is 0 (docs/chat.md)."),
    ("greedy agreement", "the share of greedy tokens an export gives as gpt2train gives them on the same prompts; "
     "1.0 is a faithful export in float32 (docs/export.md)."),
]


def write_card(pipeline: Pipeline, outcomes: list[Outcome], source: str, command: str) -> Path:
    """OUT/report.md and OUT/report.html; returns the Markdown's path."""
    markdown = card_markdown(pipeline, outcomes, source, command)
    path = pipeline.out / "report.md"
    write_text_atomic(path, markdown)
    write_text_atomic(pipeline.out / "report.html", card_html(markdown, pipeline.name))
    return path


def card_markdown(pipeline: Pipeline, outcomes: list[Outcome], source: str, command: str) -> str:
    total = sum(o.record.seconds or 0 for o in outcomes)
    lines = [f"# Report card: {pipeline.name}", "", pipeline.description, "",
             f"- made: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; the stages took {format_duration(total)} "
             f"in all ({format_duration(sum(o.record.seconds or 0 for o in outcomes if not o.skipped))} in this run)",
             f"- machine: {machine()}",
             f"- code: {commit()}",
             f"- pipeline: {source}, in {pipeline.out}: `{command}`", "",
             "## Stages", "", "| stage | command | time | this run | measured |", "| --- | --- | ---: | --- | --- |"]
    for o in outcomes:
        seconds = format_duration(o.record.seconds or 0)
        lines.append(f"| {o.stage.name} | `{o.stage.command}` | {seconds} | {'skipped (done)' if o.skipped else 'ran'} "
                     f"| {summary(o)} |")
    lines += suite_tables(outcomes) + transcript(outcomes)
    lines += ["", "## What the numbers mean", ""] + [f"- **{name}**: {text}" for name, text in MEANINGS]
    return "\n".join(lines) + "\n"


def summary(o: Outcome) -> str:
    m, command = o.record.measured, o.stage.argv[0]
    if command in ("prepare", "tokenizer"):
        if "train_tokens" not in m:
            return format_bytes(m.get("bytes", 0))
        kind = "conversations" if m.get("chat") else "documents"
        docs = f", {m['documents']:,} {kind}" if m.get("documents") else ""
        return f"{format_count(m['train_tokens'])} train and {format_count(m['val_tokens'])} val tokens{docs} ({m['tokenizer']})"
    if command == "train":
        loss = "" if m.get("best_val_loss") is None else f"; best val loss {m['best_val_loss']:.4f}"
        bpb = "" if m.get("best_val_bpb") is None else f" ({m['best_val_bpb']:.4f} bits/byte)"
        return f"{m.get('steps') or 0:,} steps, {format_count(m.get('tokens') or 0)} tokens{loss}{bpb}"
    if command == "eval":
        return "; ".join(filter(None, (task_line(task, r) for task, r in m["tasks"].items())))
    size = format_bytes(m.get("bytes", 0))
    if m.get("agreement") is None:
        return f"{size}; greedy agreement not measured ({m.get('why', 'no reader')})"
    return (f"{size}; greedy agreement {m['agreement']:.3f} over {m['tokens']} tokens (logits within "
            f"{m['max_logit_diff']:.1e} of gpt2train's)")


def task_line(task: str, r: dict) -> str:
    if task == "val":
        bpb = f", {r['bpb']:.4f} bits/byte" if r.get("bpb") is not None else ""
        return f"val loss {r['loss']:.4f}{bpb}"
    if task == "chat":
        return f"exact match {r['exact_match']:.3f} ({r['correct']} of {r['n']} held-out conversations)"
    if "centered_mean" in r:
        return f"{task.upper() if task == 'core' else task} mean centered {r['centered_mean']:.4f} ({len(r['tasks'])} tasks)"
    if task == "hellaswag":
        return f"HellaSwag acc {r.get('acc_norm', r.get('acc', 0)):.4f}"
    return ""  # a suite task: in its own table


def suite_tables(outcomes: list[Outcome]) -> list[str]:
    lines = []
    for o in outcomes:
        tasks = o.record.measured.get("tasks", {}) if o.stage.argv[0] == "eval" else {}
        rows = [(t, r) for t, r in tasks.items() if "centered" in r]
        if not rows:
            continue
        lines += ["", f"## {o.stage.name}: the suite, task by task", "", "| task | accuracy | centered | examples |",
                  "| --- | ---: | ---: | ---: |"]
        lines += [f"| {t} | {r['acc']:.4f} | {r['centered']:.4f} | {r.get('n', '')} |" for t, r in rows]
    return lines


def transcript(outcomes: list[Outcome]) -> list[str]:
    """The chat eval's held-out conversations: what was asked, the model's reply and the reference."""
    lines = []
    for o in outcomes:
        chat = o.record.measured.get("tasks", {}).get("chat") if o.stage.argv[0] == "eval" else None
        if not chat or not chat.get("examples"):
            continue
        lines += ["", f"## {o.stage.name}: the model answering held-out conversations", ""]
        for example in chat["examples"]:
            asked = example["prompt"].replace("<|endoftext|>", "").strip()
            reply = "(no reply: it never ended its turn)" if example["reply"] is None else example["reply"]
            lines += ["```", asked, f"[reply]     {reply}", f"[reference] {example['reference']}", "```"]
    return lines


def machine() -> str:
    import torch

    from gpt2train.devices import cpu_name

    gpu = f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{cpu_name()} ({platform.machine()}){gpu}, torch {torch.__version__}, Python {platform.python_version()}"


def commit() -> str:
    import gpt2train

    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(gpt2train.__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"gpt2train {gpt2train.__version__}" + (f", commit {sha}" if sha else "")


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
{style}</head>
<body>
{body}
</body></html>
"""


def report_style() -> str:
    """The <style> of `gpt2train report`'s page (templates/report.html): the card looks like the run's report."""
    import importlib.resources

    page = importlib.resources.files("gpt2train").joinpath("templates/report.html").read_text(encoding="utf-8")
    start, end = page.find("<style>"), page.find("</style>")
    return page[start:end + len("</style>")] if 0 <= start < end else ""


def card_html(markdown: str, name: str) -> str:
    """The card's Markdown as a page: headings, lists, tables and code blocks, the only forms it writes."""
    out, table, code = [], [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            out.append("</pre>" if code else "<pre>")
            code = not code
            continue
        if code:
            out.append(html.escape(line))
            continue
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            tag = "th" if not table else "td"  # a table's first row is its header
            if not set("".join(cells)) <= set("-: "):
                table.append("<tr>" + "".join(f"<{tag}>{inline(c)}</{tag}>" for c in cells) + "</tr>")
            continue
        if table:
            out.append("<table>" + "".join(table) + "</table>")
            table = []
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{inline(line.lstrip('#').strip())}</h{level}>")
        elif line.startswith("- "):
            out.append(f"<p>&bull; {inline(line[2:])}</p>")
        elif line:
            out.append(f"<p>{inline(line)}</p>")
    if table:
        out.append("<table>" + "".join(table) + "</table>")
    return PAGE.format(title=html.escape(f"Report card: {name}"), style=report_style(), body="\n".join(out))


def inline(text: str) -> str:
    """`code` and **bold** of a Markdown line, the rest escaped."""
    parts = html.escape(text).split("`")
    text = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    parts = text.split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))
