#!/usr/bin/env bash
# One prefill and one decode vLLM instance with MoriTorchConnector on one
# machine with two GPUs, and the toy proxy in front (README "vLLM:
# disaggregated prefill/decode with MoriTorchConnector").
#   MODEL=Qwen/Qwen3-0.6B examples/vllm_disagg/launch.sh
# BACKEND=xgmi (GPUs of one node, default here), tcp (anywhere) or rdma.
set -euo pipefail
# What this needs, checked first so that a machine without it gets one clear
# line instead of two servers failing.
PYTHON=${PYTHON:-python}
command -v vllm >/dev/null || { echo "launch.sh needs vLLM: no \`vllm\` command on PATH (pip install vllm)" >&2; exit 1; }
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
((gpus >= 2)) || { echo "launch.sh needs two GPUs (one prefill, one decode instance); torch sees $gpus" >&2; exit 1; }
MODEL=${MODEL:?set MODEL to a model vLLM can serve}
BACKEND=${BACKEND:-xgmi}
HOST=${HOST:-127.0.0.1}
STORE_PORT=${STORE_PORT:-29600}

cfg() {  # role, extra JSON fields
  printf '{"kv_connector":"MoriTorchConnector","kv_connector_module_path":"mori_torch.integrations.vllm","kv_role":"%s","kv_connector_extra_config":{"rendezvous":"tcpstore://%s:%s","backend":"%s","host":"%s"%s}}' \
    "$1" "$HOST" "$STORE_PORT" "$BACKEND" "$HOST" "$2"
}

# The prefill hosts the TCPStore directory (rendezvous_serve); with etcd use
# "rendezvous":"etcd://HOST:2379" on both and drop rendezvous_serve.
CUDA_VISIBLE_DEVICES=0 vllm serve "$MODEL" --port 8100 \
  --kv-transfer-config "$(cfg kv_producer ',"rendezvous_serve":true,"side_channel_port":14600')" &
CUDA_VISIBLE_DEVICES=1 vllm serve "$MODEL" --port 8200 \
  --kv-transfer-config "$(cfg kv_consumer '')" &
"$PYTHON" "$(dirname "$0")/proxy.py" --port 8000 --prefill "http://$HOST:8100" --decode "http://$HOST:8200" &
trap 'kill $(jobs -p) 2>/dev/null' EXIT
echo "waiting for the servers; then: curl http://$HOST:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\":\"$MODEL\",\"prompt\":\"Hello\",\"max_tokens\":32}'"
wait
