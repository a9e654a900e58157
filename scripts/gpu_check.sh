#!/usr/bin/env bash
# README's GPU rows, in one prepared run on a lent GPU machine (issue 9, item 4).
#
# The device machine has torch, typer, rich and safetensors but no network, so paramfold runs from
# this checkout's src/ (no install). Each bench writes its JSON document (every sample) to $OUT,
# then all are rendered as tables into $OUT/tables.txt, with the torch version and the date.
# Each bench is bounded by PARAMFOLD_CHECK_LIMIT seconds (default 150) so that the whole run
# stays under the device tool's 10-minute command limit; one that fails or times out is
# reported in tables.txt and the others still run.
#
#     bash scripts/gpu_check.sh                               # on the GPU machine, from the repo root
#     PARAMFOLD_CHECK_DEVICE=cpu PARAMFOLD_CHECK_QUICK=1 OUT=/tmp/gpu bash scripts/gpu_check.sh
#                                                             # the script itself, tiny, on CPU (tested)
set -uo pipefail
out=${OUT:-gpu_check_out}
device=${PARAMFOLD_CHECK_DEVICE:-cuda}
limit=${PARAMFOLD_CHECK_LIMIT:-150}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [[ -n "${PARAMFOLD_CHECK_QUICK:-}" ]]; then
    size=(--layers 2 --width 8) sn_size=(--layers 2 --width 8) reps=(--repeats 1 --steady-rounds 1 --variant hoist)
    backend=eager
else
    size=() sn_size=(--layers 16 --width 64) reps=(--repeats 2 --steady-rounds 5) backend=inductor
fi

names=()
bench() {  # NAME ARGS...: one `paramfold bench --json` into $OUT/NAME.json, its progress into NAME.log
    local name=$1; shift
    names+=("$name")
    echo "== $name: paramfold bench --device $device $*" >&2
    timeout "$limit" "$py" -m paramfold bench --device "$device" --json "$@" >"$out/$name.json" 2>"$out/$name.log"
    echo "   exit $?" >>"$out/$name.log"
}

bench seed_eval "${size[@]}" --backend "$backend" "${reps[@]}"
bench seed_train "${size[@]}" --train --backend "$backend" "${reps[@]}"
bench sn_train --model spectral_norm "${sn_size[@]}" --train --backend "$backend" "${reps[@]}"
bench sn_grad --model spectral_norm "${sn_size[@]}" --grad --backend "$backend" "${reps[@]}"

"$py" - "$out" "${names[@]}" >"$out/tables.txt" <<'PY'
import datetime, json, sys
from pathlib import Path

import torch
from rich.console import Console

from paramfold.bench.render import to_rich_table
from paramfold.bench.result import BenchResult

out, names = Path(sys.argv[1]), sys.argv[2:]
console = Console(width=200, force_terminal=False, color_system=None)
console.print(f"{datetime.date.today()} torch {torch.__version__}, "
              f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")
for name in names:
    console.print(f"\n== {name}")
    try:
        result = BenchResult.from_dict(json.loads((out / f"{name}.json").read_text()))
    except Exception as e:  # a bench that failed or timed out: say so, keep the others
        tail = (out / f"{name}.log").read_text().strip().splitlines()[-2:]
        console.print(f"no result ({type(e).__name__}); log: {' | '.join(tail)}")
        continue
    console.print(to_rich_table(result, wide=True))
PY
cat "$out/tables.txt"
