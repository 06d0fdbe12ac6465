#!/usr/bin/env bash
# Wheels for Hugging Face transformers on the offline GPU machine (python 3.12, x86_64), into the ignored
# .gpu-deps/transformers/. Then, there:
#   python3 -m pip install --no-index --no-deps --target /tmp/site .gpu-deps/transformers/*.whl
#   PYTHONPATH=/tmp/site python3 bench/transformers_vision.py --write
# The set is what `import transformers` and the Qwen2.5-VL vision tower need, checked by running
# bench/transformers_vision.py --smoke with only these beside torch's own dependencies (numpy, filelock,
# fsspec, typing-extensions come with torch there): huggingface_hub imports httpx2 at import time (anyio,
# h11, idna, httpcore2, truststore); transformers checks tqdm, regex, packaging, pyyaml, tokenizers and
# safetensors on import. Its CLI-only requirement typer (click, rich, pydantic, ...) and hf-xet are left out.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.gpu-deps/transformers
if [ -z "${PIP:-}" ]; then
  if [ -x .venv/bin/python ]; then PIP=".venv/bin/python -m pip"; else PIP="python3 -m pip"; fi
fi
PACKAGES=(
  transformers==5.24.0 tokenizers==0.23.3 huggingface_hub==2.4.0 safetensors==0.8.0 regex==2026.11.19
  pyyaml==6.0.4 tqdm==4.70.1 packaging==26.4
  httpx2==2.16.2 httpcore2==2.16.2 anyio==4.16.0 h11==0.16.0 idna==3.20 truststore==0.10.5
)
rm -rf "$DEST"
mkdir -p "$DEST"
for package in "${PACKAGES[@]}"; do
  $PIP download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any --dest "$DEST" "$package"
done
ls -l "$DEST"
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
