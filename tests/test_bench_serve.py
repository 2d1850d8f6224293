"""`gpt2train bench serve`: a tiny run against a real server writes its table and JSON, with the plain
decode beside each level; bad arguments are one usage line before any work."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, run_cli, run_here
from gpt2train import cli
from gpt2train.bench.serve import Level, ServeBenchOptions, targets
from gpt2train.ranges import UsageError

LEVEL_KEYS = {"concurrency", "requests", "errors", "wall_s", "requests_s", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
              "itl_p50_ms", "itl_p99_ms", "completion_tokens", "plain_tok_s", "of_plain", "error_examples"}


@pytest.mark.slow
def test_bench_serve_command_writes_json(tmp_path):
    out = tmp_path / "serve.json"
    result = run_cli("bench", "serve", "--model", "gpt2-tiny", "--device", "cpu", "--dtype", "float32",
                     "--concurrency", "1,2", "--requests", "3", "--prompt-tokens", "4", "--new-tokens", "6",
                     "--repeats", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr + result.stdout
    assert "| concurrency |" in result.stdout and "plain: decode: eager" in result.stdout
    data = json.loads(out.read_text())
    assert {"model", "device", "dtype", "threads", "prompt_tokens", "new_tokens", "max_batch", "date", "torch",
            "decode_path", "levels", "targets", "markdown"} <= data.keys()
    assert data["dtype"] == "float32" and data["max_batch"] == 2
    assert [level["concurrency"] for level in data["levels"]] == [1, 2]
    for level in data["levels"]:
        assert level.keys() == LEVEL_KEYS
        assert level["errors"] == 0 and level["requests"] == 3, level["error_examples"]
        assert level["completion_tokens"] <= 3 * 6 and level["output_tok_s"] > 0 and level["plain_tok_s"] > 0
        assert 0 < level["ttft_p50_ms"] <= level["ttft_p99_ms"]
    assert data["targets"] == {"errors": 0}  # the targets need concurrency 1 and 8


def test_the_targets_of_issue_31():
    def level(concurrency, tok_s, plain, ttft, errors=0):
        return Level(concurrency, 16, errors, 1.0, 1.0, tok_s, ttft, ttft, 1.0, 1.0, 100, plain, tok_s / plain)

    met = targets([level(1, 10, 12, 100), level(8, 40, 45, 250)])
    assert met["met"] == {"throughput_8_over_1 >= 3": True, "of_plain_8 >= 0.85": True, "ttft_p50_8_over_1 <= 3": True,
                          "errors == 0": True}
    missed = targets([level(1, 10, 12, 100), level(8, 25, 40, 400, errors=1)])
    assert not any(missed["met"].values())


@pytest.mark.slow
@pytest.mark.parametrize("args, says", [
    (["--model", "gpt3"], "argument --model: invalid choice: 'gpt3' (choose from 'gpt2', "),
    (["--concurrency", "1,x"], "'x' is not an integer"),
    (["--concurrency", "0"], "0 is out of range"),
    (["--new-tokens", "200"], "exceed gpt2-tiny's block_size 128"),
])
def test_bad_arguments_are_one_usage_line_before_any_work(tmp_path, args, says):
    r = run_here("bench", "serve", "--model", "gpt2-tiny", *args, "--out", str(tmp_path / "serve.json"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().startswith("error:") and says in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_the_context_check_is_the_one_bench_generate_has():
    """bench serve's options had a twin of bench generate's checks; both now call check_context."""
    with pytest.raises(UsageError, match="--prompt-tokens 100 \\+ --new-tokens 100 exceed gpt2-tiny's block_size 128"):
        ServeBenchOptions(model="gpt2-tiny", prompt_tokens=100, new_tokens=100)


def test_benchmarks_readme_gives_the_default_of_requests_that_the_command_uses(capsys):
    """The code sends four times the level (bench/serve.py); --help and benchmarks/README.md say so."""
    with pytest.raises(SystemExit):
        cli.main(["bench", "serve", "--help"])
    assert "0: four times the level" in " ".join(capsys.readouterr().out.split())
    readme = (REPO / "benchmarks" / "README.md").read_text()
    serving = " ".join(readme.split("## Serving (`gpt2train bench serve`)", 1)[1].split("\n## ", 1)[0].split())
    assert "`--requests N` per level (default four times the level)" in serving
