"""The run log: what the writer writes the reader reads back, damage tolerated, the schema as documented."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2train import runlog
from gpt2train.runlog import MetricsLogger, RunLogError, load_metrics, load_run

REPO = Path(__file__).resolve().parents[1]


def write_with_logger(run_dir: Path) -> list[dict]:
    """Log one small run through MetricsLogger; return what was logged, as (kind, fields) dicts."""
    logged = [
        {"kind": "run_start", "step": 1, "config": {"train": {"lr": 1e-3}}, "hardware": {"device": "cpu"},
         "resumed_from": None},
        {"kind": "train", "step": 1, "tokens": 64, "loss": 4.0, "lr": 1e-3, "grad_norm": 1.5, "mfu": None},
        {"kind": "train", "step": 2, "tokens": 128, "loss": 3.5, "lr": 1e-3, "grad_norm": 1.2, "mfu": None},
        {"kind": "val", "step": 2, "tokens": 128, "val_loss": 3.6, "val_ppl": 36.6},
        {"kind": "sample", "step": 2, "prompt": "\n", "text": 'a "quoted" line\nand another'},
        {"kind": "run_end", "step": 2, "tokens": 128, "wall_s": 1.0, "reason": "done"},
    ]
    logger = MetricsLogger(run_dir)
    for rec in logged:
        fields = {k: v for k, v in rec.items() if k != "kind"}
        logger.log(rec["kind"], **fields)
    logger.close()
    return logged


def test_writer_output_reads_back_record_for_record(tmp_path):
    logged = write_with_logger(tmp_path)

    records = load_metrics(tmp_path)
    assert [{k: v for k, v in r.items() if k != "time"} for r in records] == logged
    assert all(isinstance(r["time"], float) for r in records)  # the writer stamps every record


def test_inactive_writer_writes_nothing(tmp_path):
    logger = MetricsLogger(None)  # what ranks other than 0 build
    logger.log("train", step=1, loss=1.0)
    logger.close()
    assert not logger.active and logger.file is None
    assert not list(tmp_path.iterdir())


def test_unknown_kind_and_cut_last_line_keep_every_known_record(tmp_path):
    logged = write_with_logger(tmp_path)
    with open(tmp_path / runlog.METRICS_FILE, "a") as f:
        f.write(json.dumps({"kind": "from_the_future", "time": 9.0, "step": 3}) + "\n")
        f.write('{"kind": "train", "time": 10.0, "st')  # a crash mid-write

    run = load_run(tmp_path)
    assert [r["kind"] for r in run.records] == [r["kind"] for r in logged]
    assert run.truncated_last_line and run.malformed_lines == 0


def test_malformed_middle_line_is_counted_not_fatal(tmp_path):
    write_with_logger(tmp_path)
    path = tmp_path / runlog.METRICS_FILE
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2] + ["{not json"] + lines[2:]) + "\n")

    run = load_run(tmp_path)
    assert run.malformed_lines == 1 and not run.truncated_last_line
    assert len(run.records) == len(lines)


def test_unreadable_log_is_a_one_line_value_error(tmp_path):
    (tmp_path / runlog.METRICS_FILE).write_text("garbage\n[1, 2]\n")
    with pytest.raises(RunLogError, match="no readable records") as info:
        load_metrics(tmp_path)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


def test_summarize_from_records_in_memory():
    lines = [
        {"kind": "run_start", "time": 0.0, "step": 1, "config": {"model": {"n_layer": 2}}},
        {"kind": "train", "time": 1.0, "step": 1, "tokens": 10, "loss": 5.0, "tokens_per_s": 99.0, "compile_ms": 5.0},
        {"kind": "train", "time": 2.0, "step": 2, "tokens": 20, "loss": 4.0, "tokens_per_s": 10.0},
        {"kind": "val", "time": 2.5, "step": 2, "tokens": 20, "val_loss": 4.2},
    ]
    run = runlog.read_run("\n".join(json.dumps(r) for r in lines), Path("runs/mem"), "mem")
    s = runlog.summarize(run)
    assert s["steps"] == 2 and s["tokens"] == 20 and s["best_val_loss"] == 4.2 and s["n_layer"] == 2
    assert s["mean_tokens_per_s"] == 10.0  # the compiled first step is left out
    assert s["status"].startswith("in progress") and s["wall_s"] == 2.5


def test_schema_constants_match_docs():
    """Every kind and field named in runlog is in docs/metrics.md's table, and every documented kind in runlog."""
    rows = {}
    for line in (REPO / "docs" / "metrics.md").read_text().splitlines():
        m = re.match(r"\| `(\w+)` \|[^|]*\|(.*)\|$", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`(\w+)`", m.group(2)))
    assert set(rows) == set(runlog.KNOWN_KINDS) == set(runlog.FIELDS)
    for kind, fields in runlog.FIELDS.items():
        assert set(fields) <= rows[kind], kind
    assert set(runlog.HARDWARE_FIELDS) <= rows[runlog.RUN_START]
    assert set(runlog.RUNTIME_FIELDS) <= rows[runlog.RUN_START]
    assert set(runlog.SUITE_TASK_FIELDS) <= rows[runlog.SUITE]


def test_runlog_imports_nothing_above_it():
    # The trainer writes through runlog, so runlog must not pull in the trainer, the report or the tools.
    code = ("import sys, gpt2train.runlog; "
            "print(' '.join(m for m in sys.modules if m.startswith('gpt2train.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")}).stdout.split()
    assert "gpt2train.runlog" in out
    assert [m for m in out if m not in ("gpt2train.runlog", "gpt2train.spikes")] == []  # spikes: the rule find_spikes applies
