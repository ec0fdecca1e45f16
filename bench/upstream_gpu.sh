#!/usr/bin/env bash
# On a GPU machine (the device): upstream's neighbouring suites pristine vs patched and the
# carried tests under torchrun (`python -m mcore_fixes suites`), and, alongside on the CPU, the
# fork wheel installed with `pip install --no-deps` and our CPU proofs run against it.
#
#   bash bench/upstream_gpu.sh DEV_DIR OUT [BASELINE...]     (default: main)
#
# DEV_DIR holds mlm-<BASELINE>.tar.gz per baseline (`git archive` of a full Megatron-LM checkout
# at its pinned commit), whl/*.whl (packages the machine lacks, e.g. mock) and, optionally,
# fork/*.whl (a fork wheel built with `pip wheel --no-deps .`). Writes suites-<BASELINE>.log,
# suites-<BASELINE>-report.md, suites-<BASELINE>-junit.tgz and fork-wheel.log into OUT.
# WHEELS (default DEV_DIR/whl) names the wheel folders installed into SITE (default /tmp/site),
# e.g. WHEELS="DEV_DIR/whl .gpu/whl" for a run with Transformer Engine; TAG (default empty)
# suffixes the file names. Two runs of one baseline share build/suites/<BASELINE>: run them one
# after the other.
set -uo pipefail
dev=$(cd "$1" && pwd)
out=$2
shift 2
baselines=("${@:-main}")
proj=$(pwd)
py=$(command -v python3)
mkdir -p "$out" /opt/data # upstream's conftest downloads test data unless /opt/data has a file
[ -n "$(ls -A /opt/data)" ] || touch /opt/data/.mcore-fixes-placeholder
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
site=${SITE:-/tmp/site}
tag=${TAG:-}
wheels=()
for d in ${WHEELS:-$dev/whl}; do
    wheels+=("$d"/*.whl)
done
if ls "${wheels[@]}" >/dev/null 2>&1; then # one call: separate ones replace shared folders
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}" || exit
    export PYTHONPATH=$site
fi
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
[ "$ngpu" -ge 1 ] || ngpu=1 # a CPU-only dry run
{
    nvidia-smi -L
    python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'
    python3 -c 'import transformer_engine as te, transformer_engine.pytorch; print("TE", te.__version__)' ||
        echo "no Transformer Engine"
    git --version
} 2>&1 | tee "$out/device.log"

fork_wheel() {
    set -x
    local whl
    whl=$(ls "$dev"/fork/*.whl) || return
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fork "$whl" || return
    cd /tmp || return # never the project root: its ./megatron must not shadow the package
    PYTHONPATH=/tmp/fork:$site python3 - <<'EOF'
import importlib.metadata as md
import megatron.core
print("megatron-core", md.version("megatron-core"), "from", megatron.core.__file__)
EOF
    PYTHONPATH=/tmp/fork:$site:$proj python3 -m mcore_fixes info
    # CPU proofs: gloo worlds forked from the test; no CUDA (a fork after CUDA init fails)
    CUDA_VISIBLE_DEVICES= PYTHONPATH=/tmp/fork:$site timeout 300 python3 -m pytest -q -p no:cacheprovider \
        --noconftest -o addopts= "$proj"/tests/proofs/
}
if [ -d "$dev/fork" ]; then
    fork_wheel >"$out/fork-wheel.log" 2>&1 &
    fork_pid=$!
fi

targs=""  # a test that hangs (a collective waiting for ranks that do not exist) must not stall all
python3 -c "import pytest_timeout" 2>/dev/null && targs="--timeout=${TEST_TIMEOUT:-120}"
targs="$targs --continue-on-collection-errors" # a file that fails to import must not stop the rest
for b in "${baselines[@]}"; do
    cp "$out/device.log" "$out/suites-$b$tag.log"
    python3 -m mcore_fixes suites "$dev/mlm-$b.tar.gz" --baseline "$b" --nproc "$ngpu" \
        --python "$py" --out "/tmp/suites-$b$tag" --timeout "${SUITES_TIMEOUT:-330}" \
        --pytest-args="$targs" 2>&1 | tee -a "$out/suites-$b$tag.log"
    cp "/tmp/suites-$b$tag/report.md" "$out/suites-$b$tag-report.md"
    tar czf "$out/suites-$b$tag-junit.tgz" -C "/tmp/suites-$b$tag" .
done
if [ -n "${fork_pid:-}" ]; then
    wait "$fork_pid"
    echo "fork wheel check: exit $?" >>"$out/fork-wheel.log"
fi
