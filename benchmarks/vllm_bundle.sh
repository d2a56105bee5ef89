# Sourced by the GPU scripts: installs the vLLM 0.26 bundle from $VK (once per machine: /tmp/site/vllm_env.sh
# marks it done), sources its environment and puts this checkout on PYTHONPATH. Needs VK and OUT set; returns 1
# with the install log's tail when the install fails.
# shellcheck shell=bash
if [ ! -f /tmp/site/vllm_env.sh ]; then
    mkdir -p /tmp/vk && cp "$VK"/vllm026-* /tmp/vk/ && VK=/tmp/vk bash "$VK/install_on_device.sh" > "$OUT/install.log" 2>&1 \
        || { tail -20 "$OUT/install.log"; return 1; }
    tail -1 "$OUT/install.log"
fi
# shellcheck disable=SC1091
source /tmp/site/vllm_env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
