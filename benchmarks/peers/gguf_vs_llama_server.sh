#!/usr/bin/env bash
# infer serve vs llama.cpp's llama-server on one GGUF file, over HTTP, driven by an outside
# client (guidellm), the two servers taking turns: llama.cpp, infer, llama.cpp, infer, ...
#
#   LLAMA_CPP_BIN=.../llama.cpp/build/bin GUIDELLM=~/peers/guidellm/bin/guidellm \
#   bash benchmarks/peers/gguf_vs_llama_server.sh MODEL.gguf TOKENIZER_DIR OUT_DIR [ROUNDS]
#
# Each round and server: 128-token synthetic prompts, 64 output tokens, concurrency 1, 4 and
# 16 (10, 12 and 48 requests). llama-server gets 16 slots and 2 threads (-np 16 -t 2 -tb 2);
# infer serve runs with its defaults. Then `python benchmarks/peers/guidellm_table.py OUT_DIR`
# writes the table. How to build llama-server and install guidellm: ../shared/design/PEERS.md.
set -euo pipefail
MODEL=$1 TOK=$2 OUT=$3 ROUNDS=${4:-2}
BIN=${LLAMA_CPP_BIN:?set LLAMA_CPP_BIN to llama.cpp build/bin}
G=${GUIDELLM:-guidellm}
mkdir -p "$OUT"

wait_healthy() {
  for _ in $(seq 240); do curl -s "$1/health" | grep -q ok && return 0; sleep 1; done
  echo "no /health from $1" >&2; return 1
}

drive() {  # name url round
  for C in 1 4 16; do
    N=$(( C == 1 ? 10 : C * 3 ))
    "$G" run --backend "kind=openai_http,target=$2" --tokenizer "kind=hf_auto,model=$TOK" \
      --data kind=synthetic_text,prompt_tokens=128,output_tokens=64 \
      --profile "kind=concurrent,streams=$C" --constraint "kind=max_requests,count=$N" \
      --output "kind=json,path=$OUT/$1-r$3-c$C.json" > "$OUT/$1-r$3-c$C.log" 2>&1
    echo "$1 round $3 C=$C done"
  done
}

for round in $(seq "$ROUNDS"); do
  "$BIN/llama-server" -m "$MODEL" --host 127.0.0.1 --port 8300 -np 16 -c 8192 -t 2 -tb 2 \
    > "$OUT/llama-server-r$round.log" 2>&1 & pid=$!
  wait_healthy http://127.0.0.1:8300 && drive llamacpp http://127.0.0.1:8300 "$round"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  infer serve --model "$MODEL" --host 127.0.0.1 --port 8400 > "$OUT/infer-r$round.log" 2>&1 &
  pid=$!
  wait_healthy http://127.0.0.1:8400 && drive infer http://127.0.0.1:8400 "$round"
  kill "$pid"; wait "$pid" 2>/dev/null || true
done
