#!/usr/bin/env bash
# One device session for the torch executor on CUDA (see docs/benchmarks.md, "Torch executor on a GPU").
# Runs on a machine whose python3 has torch + CUDA; the gateway's pure-Python dependencies that the
# machine lacks come as wheels in $WHEELS (pip download --python-version 3.12 ... on the host).
# Writes JSON results and logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
WHEELS=${WHEELS:-.gpuwheels}
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

step() { echo "== $*"; }

step "gpu_check llama-3.2-1b bf16"
timeout 150 python3 -m backends.gpu_check --shape llama-3.2-1b --out "$OUT/gpu_check_1b.json"
step "gpu_check llama-3.1-8b bf16"
timeout 150 python3 -m backends.gpu_check --shape llama-3.1-8b --decode-batches 1,32,128 --out "$OUT/gpu_check_8b.json"
step "calibrate the sim cost model from llama-3.1-8b"
timeout 200 python3 -m backends.engine.calibrate --executor torch --shape llama-3.1-8b --device cuda \
  --repeats 2 --out "$OUT/cost_h200_llama31_8b.json" > "$OUT/calibrate.log" 2>&1
tail -8 "$OUT/calibrate.log"

hol() {  # $1 label, rest: backend flags
  local label=$1; shift
  python3 -m backends.reference --executor torch --shape llama-3.1-8b --device cuda --port 8101 \
    --max-model-len 32768 --num-blocks 16384 "$@" > "$OUT/backend_$label.log" 2>&1 &
  local pid=$!
  for _ in $(seq 120); do curl -sf localhost:8101/health >/dev/null && break; sleep 0.5; done
  timeout 120 python3 -m loadtest.hol_probe --url http://127.0.0.1:8101 --label "$label" --out "$OUT/hol_$label.json"
  if [ "$label" = default ]; then
    python3 -m gateway.cli serve --config scripts/gpu_gateway.yaml --port 8180 > "$OUT/gateway.log" 2>&1 &
    local gw=$!
    for _ in $(seq 60); do curl -sf localhost:8180/readyz >/dev/null && break; sleep 0.5; done
    timeout 120 python3 -m loadtest.hol_probe --url http://127.0.0.1:8180 --label gateway \
      --out "$OUT/hol_gateway.json"
    kill $gw; wait $gw 2>/dev/null
  fi
  kill $pid; wait $pid 2>/dev/null
}
step "head-of-line probe on llama-3.1-8b (direct, then through the gateway)"
hol default
hol chunk512 --long-prefill-token-threshold 512
echo "== done"
