#!/usr/bin/env bash
# The cp312 wheels that a bare lent GPU machine lacks for this project, into DIR (default .rollback/wheels in
# the checkout, which git ignores): run here, where PyPI is reachable, then carry DIR to the machine, where
# benchmarks/device/run.sh installs them with `pip install --no-index --no-deps --target`.
#
#     bash benchmarks/device/wheels.sh [DIR]
#
# The machine (an H200, measured 2026-11-28) has Python 3.12 and torch 2.11+cu130 but not pydantic, tenacity,
# torchdata, typer, mlflow (and its dependencies) or prefect. Everything this project's pyproject.toml pins is
# resolved for CPython 3.12 on manylinux x86-64, binary wheels only, then whatever the image already has is
# dropped (PRESENT below), and torch with its CUDA wheels never comes: the image's CUDA build stays.
# About 56 MB; the machine takes at most 64 MiB with the checkout, so keep the checkout small.
set -euo pipefail
DIR=${1:+$(realpath -m "$1")}
cd "$(dirname "$0")/../.."
DIR=${DIR:-$PWD/.rollback/wheels}
PYTHON=${PYTHON:-python3}
mkdir -p "$DIR"
rm -f "$DIR"/*.whl # two releases of one package would stop the whole install there
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# What the H200 image has installed (pip list there, 2026-11-28): not carried.
PRESENT="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp"
# Carried although the image has them: the carried pydantic needs typing_extensions>=4.16, and the image's typer
# did not serve (the first run there, 2026-11-28, carried typer>=0.29).
NEWER=("typer>=0.29" "typing_extensions>=4.14")

# pyproject.toml's dependencies, less torch, and less torchdata, whose `torch>=2` would fetch a CUDA torch:
# torchdata alone comes without its dependencies (requests and urllib3, which the image has).
read -r -a reqs <<<"$("$PYTHON" - <<'PY'
import tomllib

deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(" ".join(d.replace(" ", "") for d in deps if not d.startswith(("torch==", "torchdata"))))
PY
)"
torchdata=$("$PYTHON" - <<'PY'
import tomllib

deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(d.replace(" ", "") for d in deps if d.startswith("torchdata")))
PY
)
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
quiet() { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; } # a local index's noise
"$PYTHON" -m pip download -q "${platform[@]}" -d "$tmp" "${reqs[@]}" "${NEWER[@]}" 2> >(quiet)
"$PYTHON" -m pip download -q "${platform[@]}" --no-deps -d "$tmp" "$torchdata" 2> >(quiet)

norm() { tr 'A-Z_.' 'a-z--' <<<"$1"; }
present=" $(norm "${PRESENT//$'\n'/ }") "
kept=0
for f in "$tmp"/*.whl; do
    name=$(norm "$(basename "$f" | cut -d- -f1)")
    case $name in torch | triton | nvidia-*) continue ;; esac
    if [[ $present == *" $name "* && $name != typer && $name != typing-extensions ]]; then continue; fi
    cp "$f" "$DIR/"
    kept=$((kept + 1))
done
echo "$kept wheels, $(du -sh "$DIR" | cut -f1), in $DIR"
