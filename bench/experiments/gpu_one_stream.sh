#!/usr/bin/env bash
# One stream on the GPU host's random 8B 4-bit llama (Llama-3-8B's shape; $R8Q), per token after
# the first: bare mlx-lm's stream_generate (the floor), our engine in-process (no HTTP; its step
# period, launch and complete), our server streamed through HTTP (top 20; one process and
# `--engine thread`). Where the three part is the step's host side and the hand-over and HTTP.
# Set-up and paths: gpu_env.sh. Usage: OUT=... bash bench/experiments/gpu_one_stream.sh
set -u
source bench/experiments/gpu_env.sh
model_r8q
m=$R8Q
python3 -m bench.experiments.bare_stream --model $m --tokens 128 --runs 4
python3 -m bench.experiments.feature_cost --model $m --variant default --stream-requests 4 \
  --waves 0 --max-tokens 128 --top 20 2>&1 | grep "^\["
for flags in "" "--engine thread"; do
  (exec python3 -m omlx_logprobs.cli serve --model $m --port 8131 $flags) > $OUT/one_stream.log 2>&1 &
  pid=$!
  for _ in $(seq 240); do curl -sf http://127.0.0.1:8131/health >/dev/null && break; sleep 1; done
  for r in 0 1; do  # the first warms the server
    rm -f $OUT/rec.jsonl
    python3 -m bench.loadgen --base-url http://127.0.0.1:8131/v1 --model $(basename $m) --stream \
      --concurrency 1 --requests 4 --max-tokens 128 --logprobs 20 --seed $r --records $OUT/rec.jsonl \
      > /dev/null 2>&1
  done
  python3 -c "
import json, statistics
r = [json.loads(l) for l in open('$OUT/rec.jsonl')]
v = [(x['latency_s'] - x['ttft_s']) / (x['completion_tokens'] - 1) * 1e3 for x in r if x.get('ttft_s')]
print('server [$flags] top 20: %.3f ms per token (requests %s)' % (statistics.median(v), ' '.join('%.3f' % x for x in v)))"
  grep "engine:" $OUT/one_stream.log | tail -2 | cut -c1-300
  kill $pid; wait $pid 2>/dev/null
done
