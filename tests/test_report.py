"""The run report: reading metrics.jsonl (resumes, damage, unknown kinds), figures, page, summary, CLI."""

from __future__ import annotations

import html
import json
import math
import re
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
import matplotlib.image  # noqa: E402

from conftest import run_cli  # noqa: E402
from gpt2train import cli, report, runlog  # noqa: E402
from gpt2train.report import ReportError, build_report  # noqa: E402
from gpt2train.runlog import RunLogError, find_spikes, load_metrics  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
IMG_TAG = '<img src="data:image/png;base64,'
SAMPLE_TEXT = 'ROMEO: <b>thou</b> & "thee"'
BEST_VAL = 3.1234  # at step 40; the val at step 50 is worse, so "best" is not simply "last"
GPU_FIGURES = {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory"}


def run_start(step=1, t=1000.0, resumed_from=None, gpu=True):
    return {
        "kind": "run_start", "time": t, "step": step, "resumed_from": resumed_from,
        "config": {
            "model": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 256},
            "train": {"micro_batch": 8, "seq_len": 0, "lr": 6e-4, "schedule": "cosine", "dtype": "bfloat16",
                      "compile": True, "grad_clip": 1.0},
        },
        "hardware": {"device": "cuda" if gpu else "cpu", "device_name": "NVIDIA H100" if gpu else "cpu",
                     "torch": "2.13.0", "world_size": 1, "cuda": "12.8" if gpu else None},
        "git": "abc1234", "version": "0.1.0", "params": 1_234_567, "params_non_embedding": 800_000,
        "flops_per_token": 7.4e6, "peak_flops": 9.9e14 if gpu else None,
    }


def train(step, loss=None, grad_norm=None, gpu=True, t0=1000.0):
    return {
        "kind": "train", "time": t0 + step, "step": step, "tokens": step * 2048,
        "loss": loss if loss is not None else 2.0 + 8.0 * math.exp(-step / 15),
        "lr": 6e-4 * min(1.0, step / 10),
        "grad_norm": grad_norm if grad_norm is not None else 1.0 + 0.05 * math.sin(step),
        "step_ms": 100.0, "tokens_per_s": 20_000.0 + 100 * (step % 3),
        "mfu": 0.31 if gpu else None, "peak_mem_mb": 2048.0 + step if gpu else None,
        **({"compile_ms": 30_000.0} if step == 1 else {}),
    }


def val(step, loss):
    return {"kind": "val", "time": 1000.0 + step, "step": step, "tokens": step * 2048, "val_loss": loss,
            "val_ppl": math.exp(loss)}


def full_run(gpu=True, with_val=True):
    """run_start, 50 train steps with a grad-norm spike at 30 and a guard skip there, vals, a sample, the end."""
    records = [run_start(gpu=gpu)]
    for step in range(1, 51):
        records.append(train(step, grad_norm=40.0 if step == 30 else None, gpu=gpu))
        if step == 30:
            records.append({"kind": "guard", "time": 1030.5, "step": 30, "action": "skip",
                            "reason": "grad norm spike", "loss": 2.9, "grad_norm": 40.0})
        if with_val and step % 10 == 0:
            records.append(val(step, {10: 5.0, 20: 4.0, 30: 3.5, 40: BEST_VAL, 50: 3.2}[step]))
    records += [
        {"kind": "sample", "time": 1050.2, "step": 50, "prompt": "\n", "text": SAMPLE_TEXT},
        {"kind": "checkpoint", "time": 1050.3, "step": 50, "path": "ckpt/step_50.pt", "best": False},
        {"kind": "run_end", "time": 1051.0, "step": 50, "tokens": 50 * 2048, "wall_s": 51.0, "reason": "done"},
    ]
    return records


def write_run(run_dir: Path, records, tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail)
    return run_dir


def pngs(out_dir: Path) -> set[str]:
    return {p.stem for p in out_dir.glob("*.png")}


def assert_valid_png(path: Path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    h, w, _ = matplotlib.image.imread(path).shape  # decodes every pixel: a broken file fails here
    assert h > 100 and w > 100


def legend_texts(chart) -> list[str]:
    return [t.get_text() for legend in chart.figure.legends for t in legend.get_texts()]


# ----------------------------------------------------------------------------------------------
# The page


def test_report_writes_every_figure_and_a_self_contained_page(tmp_path):
    run_dir = write_run(tmp_path / "gpu-run", full_run())
    page = build_report([run_dir], None)

    out = run_dir / "report"
    assert page == out / "report.html"
    assert pngs(out) == GPU_FIGURES
    for name in GPU_FIGURES:
        assert_valid_png(out / f"{name}.png")

    text = page.read_text()
    assert text.count(IMG_TAG) == len(GPU_FIGURES)
    assert "<script" not in text and "http://" not in text and "https://" not in text  # no external assets
    assert f"{BEST_VAL:.4f}" in text
    (sample,) = re.findall(r"<pre>(.*?)</pre>", text, re.S)
    assert html.unescape(sample) == SAMPLE_TEXT and "<b>" not in sample and '"' not in sample  # escaped, not lost
    assert SAMPLE_TEXT not in text
    assert "grad norm spike" in text  # the guard event is listed
    for highlight in ("4 / 4 / 128", "NVIDIA H100", "abc1234", "bfloat16", "2.13.0", "cosine"):
        assert highlight in text


@pytest.mark.slow
def test_summary_json_matches_the_run(tmp_path):
    run_dir = write_run(tmp_path / "gpu-run", full_run())
    build_report([run_dir], tmp_path / "out")

    (summary,) = json.loads((tmp_path / "out" / "metrics.json").read_text())["runs"]
    assert summary["run"] == "gpu-run"
    assert summary["best_val_loss"] == BEST_VAL and summary["best_val_step"] == 40
    assert summary["steps"] == 50 and summary["tokens"] == 50 * 2048
    assert summary["last_train_loss"] == pytest.approx(2.0 + 8.0 * math.exp(-50 / 15))
    assert summary["wall_s"] == 51.0 and summary["status"] == "done"
    assert summary["peak_mem_mb"] == 2098.0 and summary["mean_mfu"] == pytest.approx(0.31)
    assert summary["seq_len"] == 256  # seq_len 0 means the block size
    assert summary["guard_events"] == 1 and summary["launches"] == 1
    # The compiled first step (20,100 tokens/s here) stays out of the mean.
    assert summary["mean_tokens_per_s"] == pytest.approx(sum(20_000.0 + 100 * (s % 3) for s in range(2, 51)) / 49)


def test_the_summary_shows_what_ran_beside_what_was_asked(tmp_path):
    """The report showed the config's `dtype auto` / `compile auto`; run_start's runtime record says what ran.
    A log from before the record still reads, showing what was asked, said so."""
    records = full_run()
    records[0]["config"]["train"].update(dtype="auto", compile="auto", device="auto")
    records[0]["runtime"] = {"dtype": "bfloat16", "compile": True, "device": "cuda:0"}
    old = full_run(gpu=False)
    old[0]["config"]["train"].update(dtype="auto", compile="auto", device="auto")
    build_report([write_run(tmp_path / "new", records), write_run(tmp_path / "old", old)], tmp_path / "out")

    page = (tmp_path / "out" / "report.html").read_text()
    assert ('<tr><th>dtype</th><td class="num">bfloat16 (asked: auto)</td>'
            '<td class="num">auto (asked; what ran is not recorded)</td></tr>') in page
    assert '<tr><th>compile</th><td class="num">on (asked: auto)</td>' in page
    assert ('<tr><th>device</th><td class="num">NVIDIA H100 (asked: auto)</td>'
            '<td class="num">cpu (asked: auto)</td></tr>') in page
    new, old = json.loads((tmp_path / "out" / "metrics.json").read_text())["runs"]
    assert (new["dtype"], new["dtype_ran"], new["compile"], new["compile_ran"]) == ("auto", "bfloat16", "auto", True)
    assert old["dtype_ran"] is None and old["compile_ran"] is None and old["device_name"] == "cpu"


def test_cpu_run_without_val_skips_figures_and_says_so(tmp_path):
    run_dir = write_run(tmp_path / "cpu-run", full_run(gpu=False, with_val=False))
    out = tmp_path / "out"
    out.mkdir()
    (out / "mfu.png").write_bytes(b"stale")  # from an earlier report: must not outlive its data
    page = build_report([run_dir], out)

    assert pngs(out) == {"loss", "lr", "grad_norm", "tokens_per_s"}
    text = page.read_text()
    assert text.count(IMG_TAG) == 4
    assert "MFU not drawn" in text and "Peak memory not drawn" in text and "No val records yet" in text


def test_val_records_of_nan_only_are_named_not_called_missing(tmp_path):
    """A diverged run's only val record holds NaN: the page said "No val records yet"."""
    records = full_run(gpu=False, with_val=True)
    records = [{**r, "val_loss": float("nan")} if r["kind"] == "val" else r for r in records]
    page = build_report([write_run(tmp_path / "nan", records)], tmp_path / "out").read_text()
    assert "No val records yet" not in page and "every val record holds NaN or inf" in page


def test_two_runs_overlay_on_the_same_axes(tmp_path, monkeypatch):
    a = write_run(tmp_path / "runs" / "small", full_run())
    b = write_run(tmp_path / "runs" / "wide", full_run())
    monkeypatch.chdir(tmp_path)
    page = build_report([a, b], None)

    assert page.resolve() == (tmp_path / "report" / "report.html")  # several runs: ./report
    runs = json.loads((tmp_path / "report" / "metrics.json").read_text())["runs"]
    assert [r["run"] for r in runs] == ["small", "wide"]

    charts = report._charts([runlog.load_run(a), runlog.load_run(b)])
    assert {c.name for c in charts} == GPU_FIGURES
    for chart in charts:
        assert {"small", "wide"} <= set(legend_texts(chart)), chart.name
        assert len(chart.figure.axes) == 1  # overlaid, not side by side


def test_runs_with_the_same_folder_name_get_distinct_labels(tmp_path):
    a = write_run(tmp_path / "a" / "run", full_run())
    b = write_run(tmp_path / "b" / "run", full_run())
    runs = json.loads((build_report([a, b], tmp_path / "out").parent / "metrics.json").read_text())["runs"]
    assert [r["run"] for r in runs] == ["a/run", "b/run"]


def test_run_in_progress_is_reported(tmp_path):
    records = [run_start()] + [train(s) for s in range(1, 21)]  # no run_end yet
    page = build_report([write_run(tmp_path / "live", records)], None)

    (summary,) = json.loads((page.parent / "metrics.json").read_text())["runs"]
    assert summary["status"].startswith("in progress")
    assert summary["wall_s"] == 20.0  # from run_start's time to the last record's
    assert "no sample records" in page.read_text()
    assert subtitle(page).startswith("live: in progress at step 20 (or killed: no run_end record yet): this page "
                                     "shows what its metrics.jsonl held when built")


def test_the_subtitle_says_whether_each_run_finished_stopped_or_failed(tmp_path):
    """Bug: a finished run's page said "a run in progress shows what its metrics.jsonl holds so far"."""
    stopped = full_run()[:-1] + [{"kind": "run_end", "time": 1060.0, "step": 50, "tokens": 0, "wall_s": 60.0,
                                  "reason": "signal"}]
    page = build_report([write_run(tmp_path / "done", full_run()), write_run(tmp_path / "stopped", stopped)],
                        tmp_path / "out")
    assert subtitle(page).startswith("done: finished at step 50; stopped: stopped by a signal at step 50 (continue "
                                     "it with --resume auto) &middot; generated ")
    assert "in progress" not in page.read_text()


def subtitle(page: Path) -> str:
    """The text of the line under the page's title."""
    return page.read_text().split('<p class="muted">', 1)[1].split("</p>", 1)[0]


def test_hellaswag_gets_a_figure_when_logged(tmp_path):
    records = full_run() + [{"kind": "hellaswag", "time": 1000.0 + s, "step": s, "acc": 0.26, "acc_norm": 0.27,
                             "n": 100, "source": "hs.jsonl"} for s in (25, 50)]
    page = build_report([write_run(tmp_path / "r", records)], None)
    assert pngs(page.parent) == GPU_FIGURES | {"hellaswag"}
    assert page.read_text().count(IMG_TAG) == len(GPU_FIGURES) + 1
    assert "HellaSwag&#39;s examples: r: hs.jsonl." in page.read_text()  # where they came from, named once


def test_log_y_puts_the_loss_on_a_log_scale(tmp_path):
    run = runlog.load_run(write_run(tmp_path / "r", full_run()))
    (loss,) = [c for c in report._charts([run], log_y=True) if c.name == "loss"]
    assert loss.figure.axes[0].get_yscale() == "log"


def test_report_reads_only_through_runlog(tmp_path, monkeypatch):
    """build_report gets its runs from runlog.load_run: no metrics.jsonl on disk, and still a full page."""
    text = "\n".join(json.dumps(r) for r in full_run())
    asked = []

    def fake_load_run(run_dir, name=None):
        asked.append(Path(run_dir))
        return runlog.read_run(text, run_dir, name)

    monkeypatch.setattr(runlog, "load_run", fake_load_run)
    page = build_report([tmp_path / "nowhere"], tmp_path / "out")

    assert asked == [tmp_path / "nowhere"] and not (tmp_path / "nowhere").exists()
    assert pngs(tmp_path / "out") == GPU_FIGURES and f"{BEST_VAL:.4f}" in page.read_text()


def test_page_has_every_section_and_no_unfilled_placeholder(tmp_path):
    text = build_report([write_run(tmp_path / "r", full_run())], None).read_text()
    for heading in ("<h1>gpt2train report</h1>", "<h2>Summary</h2>", "<h2>Figures</h2>",
                    "<h2>Guard events and resumes</h2>", "<h2>Last sample</h2>"):
        assert text.count(heading) == 1, heading
    assert text.count("<table>") == 2 and "<style>" in text and "{{" not in text and "{%" not in text
    assert text.index("<h2>Summary</h2>") < text.index("<h2>Figures</h2>") < text.index("<h2>Last sample</h2>")


# ----------------------------------------------------------------------------------------------
# Reading metrics.jsonl


def test_resume_replaces_the_steps_it_redoes(tmp_path):
    first = [run_start()] + [train(s, loss=5.0) for s in range(1, 31)] + [val(20, 4.5), val(30, 4.4)]
    second = [run_start(step=20, t=2000.0, resumed_from="ckpt/step_19.pt")]
    second += [train(s, loss=3.0) for s in range(20, 41)]
    run_dir = write_run(tmp_path / "resumed", first + second)

    records = load_metrics(run_dir)
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == list(range(1, 41))
    assert all(r["loss"] == (5.0 if r["step"] < 20 else 3.0) for r in records if r["kind"] == "train")
    assert [r["kind"] for r in records if r["kind"] == "val"] == []  # both vals were at re-done steps
    assert sum(r["kind"] == "run_start" for r in records) == 2  # launches stay, as history

    page = build_report([run_dir], None)
    text = page.read_text()
    assert "resume" in text and "ckpt/step_19.pt" in text
    (summary,) = json.loads((page.parent / "metrics.json").read_text())["runs"]
    assert summary["launches"] == 2 and summary["steps"] == 40 and summary["last_train_loss"] == 3.0


def test_rollback_replaces_the_steps_it_redoes(tmp_path):
    records = [run_start()] + [train(s, loss=4.0) for s in range(1, 31)]
    records.append({"kind": "guard", "time": 1031.0, "step": 30, "action": "rollback", "reason": "loss spike",
                    "loss": 40.0, "grad_norm": 90.0, "to_step": 25})
    records += [train(s, loss=2.0) for s in range(26, 36)]
    loaded = load_metrics(write_run(tmp_path / "r", records))

    trains = [r for r in loaded if r["kind"] == "train"]
    assert [r["step"] for r in trains] == list(range(1, 36))
    assert [r["loss"] for r in trains if r["step"] > 25] == [2.0] * 10
    assert [r["action"] for r in loaded if r["kind"] == "guard"] == ["rollback"]


def test_later_record_for_the_same_step_wins(tmp_path):
    records = [run_start()] + [train(s) for s in range(1, 11)] + [val(10, 4.0), val(10, 3.9)]
    vals = [r for r in load_metrics(write_run(tmp_path / "r", records)) if r["kind"] == "val"]
    assert [v["val_loss"] for v in vals] == [3.9]


@pytest.mark.slow
def test_truncated_last_line_is_tolerated(tmp_path):
    run_dir = write_run(tmp_path / "crashed", full_run()[:30], tail='{"kind": "train", "time": 10')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a cut last line is expected after a crash: no warning
        records = load_metrics(run_dir)
    assert len(records) == 30
    assert "last line of metrics.jsonl is incomplete" in build_report([run_dir], None).read_text()


@pytest.mark.slow
def test_malformed_middle_lines_are_skipped_and_counted(tmp_path):
    run_dir = tmp_path / "damaged"
    write_run(run_dir, full_run())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[5:5] = ["not json", '["a list"]', '{"kind": "train", "loss": 3.0}']  # the last has no step
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    with pytest.warns(UserWarning, match="skipped 3 malformed lines"):
        records = load_metrics(run_dir)
    assert len(records) == len(full_run())
    r = run_cli("doctor", str(run_dir))  # the command prints it as its other warnings
    assert f"warning: {run_dir / 'metrics.jsonl'}: skipped 3 malformed lines\n" in r.stderr
    with pytest.warns(UserWarning, match="skipped 3 malformed lines"):
        folder = build_report([run_dir], None).parent
    (summary,) = json.loads((folder / "metrics.json").read_text())["runs"]
    assert summary["malformed_lines"] == 3


def test_unknown_kinds_are_skipped(tmp_path):
    records = full_run() + [{"kind": "from_the_future", "time": 2000.0, "step": 1}]
    loaded = load_metrics(write_run(tmp_path / "r", records))
    assert "from_the_future" not in {r["kind"] for r in loaded}


def test_non_finite_loss_does_not_break_the_report(tmp_path):
    records = full_run()
    records[20]["loss"] = float("nan")  # json writes NaN; Python reads it back
    records[21]["grad_norm"] = float("inf")
    page = build_report([write_run(tmp_path / "r", records)], None)
    json.loads((page.parent / "metrics.json").read_text())  # still strict JSON
    assert pngs(page.parent) == GPU_FIGURES


@pytest.mark.parametrize(
    "setup, expected",
    [
        (lambda d: None, "does not exist"),
        (lambda d: d.mkdir(), "metrics.jsonl not found"),
        (lambda d: write_run(d, []).joinpath("metrics.jsonl").write_text(""), "is empty: train first"),
        (lambda d: write_run(d, []).joinpath("metrics.jsonl").write_text("garbage\n\x00\x01{{\n[1, 2]\n"),
         "no readable records"),
        (lambda d: write_run(d, [{"kind": "from_the_future", "time": 1.0}]), "no readable records"),
    ],
    ids=["missing-dir", "no-file", "empty", "garbage", "only-unknown-kinds"],
)
def test_bad_input_raises_a_one_line_run_log_error(tmp_path, setup, expected):
    run_dir = tmp_path / "runs" / "x"
    run_dir.parent.mkdir()
    setup(run_dir)
    with pytest.raises(RunLogError, match=expected) as info:
        build_report([run_dir], None)
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value) and str(run_dir) in str(info.value)


def test_missing_matplotlib_is_a_one_line_hint(tmp_path, monkeypatch):
    run_dir = write_run(tmp_path / "r", full_run())
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import now fails
    with pytest.raises(ReportError, match="pip install matplotlib"):
        build_report([run_dir], None)


# ----------------------------------------------------------------------------------------------
# Spikes and the CLI


def test_find_spikes_flags_only_the_outlier():
    norms = [1.0 + 0.02 * (i % 5) for i in range(60)]
    norms[40] = 3.0
    assert find_spikes(norms) == [40]
    assert find_spikes([0.5] * 60) == []  # flat: MAD is 0, and nothing stands out
    assert find_spikes([50.0] * 5) == []  # too little history to judge


def test_cli_report_command(tmp_path, capsys):
    run_dir = write_run(tmp_path / "r", full_run())

    assert cli.main(["report", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out" / "report.html")

    assert cli.main(["report", str(tmp_path / "nope")]) == 1  # a missing run, found while working
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist" in err and err.count("\n") == 1


def test_a_damaged_run_start_leaves_its_fields_blank(tmp_path):
    """A run_start whose config is a list and hardware a string crashed the report ('error: AttributeError:
    'list' object has no attribute 'get' (an internal error)'); those summary fields are now blank."""
    start = {**run_start(), "config": [1], "hardware": "gpu", "runtime": "x"}
    summary = runlog.summarize(runlog.load_run(write_run(tmp_path / "run", [start, *full_run()[1:]])))
    assert summary["n_layer"] is None and summary["device_name"] is None and summary["dtype_ran"] is None
    assert summary["steps"] == 50 and summary["best_val_loss"] == BEST_VAL
    build_report([tmp_path / "run"], out_dir=tmp_path / "out")
    assert (tmp_path / "out" / "report.html").is_file()
