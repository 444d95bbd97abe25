#!/usr/bin/env bash
# The wheels a GPU machine without network needs to run fitfinder from this checkout.
#
#   scripts/wheelhouse.sh DIR [--python-version 3.12] [--have "transformers peft ..."]
#                             [--torch 2.11.0] [--bnb-cuda "130 132"] [--with "PKG ..."]
#                             [--leave-out "plotly optuna-dashboard"] [--glibc 2.28] [--max-mib 60]
#
# Run it where the package index is reachable. It downloads into DIR (new or empty) the wheels of
# every runtime dependency of fitfinder (pyproject.toml's [project] dependencies), and of theirs,
# for CPython VERSION on manylinux x86-64, except:
#   - torch and its own requirements: the GPU machine has its CUDA build, never downloaded here;
#   - what the GPU machine's Python already has: --have names it (default: the device machine
#     this project is checked on), and whatever those packages require is left out too;
#   - --leave-out: plotly and optuna-dashboard by default, which only `report`, `search` (for
#     its report) and `dashboard` import; probe, estimate, calibrate and the GPU tests never do.
# fitfinder itself is no wheel: the checkout travels and `src/` goes on PYTHONPATH.
#
# bitsandbytes publishes one 43 MB manylinux wheel for all CUDA versions (0.50.x is the smallest
# there has been: 0.45-0.49 are 59-76 MB). Its copy in DIR keeps only the CPU library and the
# CUDA builds named by --bnb-cuda (default 130 132: a torch built for CUDA 13, as the GPU
# machine's 2.11.0+cu130), about 2 MB; --bnb-cuda all keeps the wheel as published. bitsandbytes
# picks its library from torch.version.cuda, so a torch built for another CUDA needs its number.
#
# Then it prints the checkout (git-tracked files) plus DIR in MiB, and fails when that passes
# --max-mib (60: the device machine takes 64 MiB of files per call; 0 turns the check off).
#
# On the GPU machine: scripts/gpu_check.sh --wheels DIR. See DEVELOPERS.md, "A GPU machine
# without network".
set -euo pipefail
called_from="$PWD"
cd "$(dirname "$0")/.."

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit "${1:-2}"; }

dir=""
python_version="3.12"
have="transformers peft accelerate pandas rich typer nvidia-ml-py pytest"
torch_version="2.11.0"
bnb_cuda="130 132"
with=""
leave_out="plotly optuna-dashboard"
glibc="2.28"
max_mib=60
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) python_version="$2"; shift 2 ;;
    --have) have="$2"; shift 2 ;;
    --torch) torch_version="$2"; shift 2 ;;
    --bnb-cuda) bnb_cuda="$2"; shift 2 ;;
    --with) with="$2"; shift 2 ;;
    --leave-out) leave_out="$2"; shift 2 ;;
    --glibc) glibc="$2"; shift 2 ;;
    --max-mib) max_mib="$2"; shift 2 ;;
    -h|--help) usage 0 ;;
    -*) echo "wheelhouse.sh: unknown option $1" >&2; usage ;;
    *) [ -z "$dir" ] || { echo "wheelhouse.sh: one DIR only (got $dir and $1)" >&2; usage; }; dir="$1"; shift ;;
  esac
done
[ -n "$dir" ] || { echo "wheelhouse.sh: give the folder to download into" >&2; usage; }
[[ "$dir" = /* ]] || dir="$called_from/$dir"
if compgen -G "$dir/*.whl" >/dev/null; then
  echo "wheelhouse.sh: $dir already holds wheels; give a new or empty folder (two versions of one package stop an install)" >&2
  exit 2
fi
mkdir -p "$dir"
PYTHON="${PYTHON:-python3}"
started=$(date +%s)

# What pip is told about the target: CPython VERSION, manylinux x86-64 up to the given glibc,
# binary wheels only (nothing is built there).
glibc_minor="${glibc#2.}"
target=(--only-binary=:all: --implementation cp --python-version "$python_version"
        --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
for ((minor = 5; minor <= glibc_minor; minor++)); do target+=(--platform "manylinux_2_${minor}_x86_64"); done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# 1. fitfinder's runtime requirements, less torch and --leave-out, plus --with.
"$PYTHON" - "$leave_out" "$with" > "$work/requirements.txt" <<'PY'
import re, sys
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
leave_out = {re.sub(r"[-_.]+", "-", name).lower() for name in sys.argv[1].split()} | {"torch"}
with open("pyproject.toml", "rb") as f:
    requirements = tomllib.load(f)["project"]["dependencies"] + sys.argv[2].split()
for requirement in requirements:
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    if re.sub(r"[-_.]+", "-", name).lower() not in leave_out:
        print(requirement)
PY

# 2. A stand-in torch wheel with no requirements: the resolver would otherwise download several
# CUDA builds of torch (0.5-0.9 GB each) to read their metadata, only to leave them out.
"$PYTHON" - "$work/stub" "$torch_version" <<'PY'
import sys, zipfile
from pathlib import Path
folder, version = Path(sys.argv[1]), sys.argv[2] + "+stub"
folder.mkdir()
info = f"torch-{version}.dist-info"
files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
         f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: fitfinder-wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as wheel:
    for name, text in files.items():
        wheel.writestr(name, text)
PY

# torch's own requirements (its CUDA libraries and triton aside): the GPU machine has them with torch.
torch_requires="filelock typing-extensions sympy networkx jinja2 fsspec setuptools"
echo "== resolving for CPython $python_version, manylinux x86-64 (glibc <= $glibc), torch $torch_version there"
echo "   fitfinder needs: $(tr '\n' ' ' < "$work/requirements.txt")"
echo "   the GPU machine has: torch ${have:-(nothing else)}"
# shellcheck disable=SC2086  # $have and $torch_requires are lists of names
"$PYTHON" -m pip install --dry-run --ignore-installed --quiet --report "$work/report.json" "${target[@]}" \
  --target "$work/never-written" --find-links "$work/stub" \
  "torch==$torch_version+stub" $torch_requires $have -r "$work/requirements.txt"

# 3. What the resolution needs, less what --have (and torch) bring along with them.
"$PYTHON" - "$work/report.json" "$python_version" "torch $torch_requires $have" > "$work/bundle.txt" <<'PY'
import json, sys
try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

report, python_version, have = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3].split()
env = default_environment() | {"python_version": python_version, "python_full_version": python_version + ".0",
                               "implementation_name": "cpython", "platform_python_implementation": "CPython",
                               "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
                               "platform_machine": "x86_64"}
resolved = {canonicalize_name(item["metadata"]["name"]): item for item in report["install"]}


def applies(requirement, extras):
    marker = requirement.marker
    return marker is None or any(marker.evaluate(env | {"extra": extra}) for extra in extras or {""})


present, todo = set(), [Requirement(text) for text in have]
while todo:  # everything --have (and torch) require, transitively, as resolved
    requirement = todo.pop()
    name = canonicalize_name(requirement.name)
    key = (name, frozenset(requirement.extras))
    if key in present or name not in resolved:
        continue
    present.add(key)
    for text in resolved[name]["metadata"].get("requires_dist", []):
        needed = Requirement(text)
        if applies(needed, requirement.extras):
            todo.append(needed)
present_names = {name for name, _ in present}
for name, item in sorted(resolved.items()):
    if name not in present_names:
        print(f"{item['metadata']['name']}=={item['metadata']['version']}")
PY

# 4. Download exactly those, no dependencies of theirs (all are in the list).
echo "== downloading into $dir: $(tr '\n' ' ' < "$work/bundle.txt")"
"$PYTHON" -m pip download --no-deps --quiet "${target[@]}" -d "$dir" -r "$work/bundle.txt"

# 5. bitsandbytes with the CPU library and the named CUDA builds only.
for wheel in "$dir"/bitsandbytes-*.whl; do
  if [ ! -e "$wheel" ] || [ "$bnb_cuda" = "all" ]; then continue; fi
  "$PYTHON" - "$wheel" "$bnb_cuda" <<'PY'
import os, re, sys, zipfile
path, keep = sys.argv[1], {f"libbitsandbytes_cuda{v}.so" for v in sys.argv[2].split()} | {"libbitsandbytes_cpu.so"}
native = re.compile(r"^bitsandbytes/libbitsandbytes_[a-z0-9]+\.so$")
before, slim = os.path.getsize(path), path + ".slim"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    dropped = {n for n in src.namelist() if native.match(n) and n.split("/")[-1] not in keep}
    for info in src.infolist():
        if info.filename in dropped:
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):  # the dropped files leave the record too
            data = b"".join(line for line in data.splitlines(keepends=True)
                            if line.split(b",")[0].decode() not in dropped)
        dst.writestr(info, data)
os.replace(slim, path)
kept = sorted(keep - {"libbitsandbytes_cpu.so"})
print(f"   bitsandbytes: kept the CPU library and {', '.join(kept)}; dropped {len(dropped)} other "
      f"native libraries ({before / 2**20:.1f} -> {os.path.getsize(path) / 2**20:.1f} MiB)")
PY
done

# 6. A note of what this is, for whoever installs it.
{
  echo "fitfinder wheelhouse, $(date -u +%FT%TZ): CPython $python_version, manylinux x86-64 (glibc <= $glibc)"
  echo "for a Python that has: torch $torch_version ${have}"
  echo "bitsandbytes CUDA builds kept: $bnb_cuda"
  echo "install: scripts/gpu_check.sh --wheels DIR, or"
  echo "  python3 -m pip install --no-index --no-deps --target PRIVATE DIR/*.whl; PYTHONPATH=PRIVATE:src python3 -m fitfinder ..."
  cat "$work/bundle.txt"
} > "$dir/BUNDLE.txt"

# 7. The size that travels: the checkout's tracked files and the wheels.
checkout_bytes=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
bundle_bytes=$(du -cb "$dir"/*.whl "$dir/BUNDLE.txt" | tail -1 | cut -f1)
total_mib=$(( (checkout_bytes + bundle_bytes + 2**20 - 1) / 2**20 ))
limit_text="limit ${max_mib} MiB"; [ "$max_mib" -gt 0 ] || limit_text="no limit"
echo "== $(find "$dir" -name '*.whl' | wc -l) wheels, $(( bundle_bytes / 2**10 )) KiB; checkout $(( checkout_bytes / 2**10 )) KiB;" \
     "together ${total_mib} MiB (${limit_text}); $(( $(date +%s) - started )) s"
if [ "$max_mib" -gt 0 ] && [ "$total_mib" -gt "$max_mib" ]; then
  echo "wheelhouse.sh: checkout plus wheels is ${total_mib} MiB, over ${max_mib} MiB: name more in --have or --leave-out" >&2
  exit 1
fi
