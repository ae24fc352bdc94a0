#!/usr/bin/env bash
# Run flash-attn's own test file (tests/test_flash_attn.py of Dao-AILab/flash-attention, kept outside the
# tracked files) against flashtile, through the `flash_attn` alias package in tests/compat/flash_attn_alias.
#
#   tests/compat/run_flash_attn_suite.sh PATH/TO/test_flash_attn.py [--sample N] [--sample-seed S] \
#       [--shard I/K] [--keep-groups] [other pytest arguments]
#
# Default tiles (FLASHTILE_AUTOTUNE=0), the groups listed in docs/compatibility.md deselected, counts per
# test function printed at the end. Needs no network: einops comes from tests/compat/einops_fallback when
# it is not installed. Without a GPU, add --cpu-as-cuda (collection and the PyTorch path only).
set -euo pipefail

if [ $# -lt 1 ] || [ ! -f "$1" ]; then
    echo "usage: $0 PATH/TO/test_flash_attn.py [--sample N] [--sample-seed S] [--shard I/K] [pytest args]" >&2
    exit 2
fi
test_file="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
alias_dir="$here/flash_attn_alias"
python="${PYTHON:-python3}"  # the interpreter with torch and triton

path="$alias_dir:$repo"
if ! "$python" -c "import einops" 2>/dev/null; then
    path="$path:$here/einops_fallback"
fi
export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}"
export FLASHTILE_AUTOTUNE=0

# The alias, not an installed flash-attn, must answer `import flash_attn`; flashtile from this checkout.
"$python" - "$alias_dir" "$repo" <<'PY'
import sys

import flash_attn
import flashtile

alias_dir, repo = sys.argv[1:]
assert flash_attn.__file__.startswith(alias_dir), f"flash_attn resolves to {flash_attn.__file__}, not the alias"
assert flashtile.__file__.startswith(repo), f"flashtile resolves to {flashtile.__file__}, not {repo}"
print(f"flash_attn -> {flash_attn.__file__}\nflashtile  -> {flashtile.__file__}")
PY

cd "$(dirname "$test_file")"
exec "$python" -m pytest "$(basename "$test_file")" -p flashtile_sample -p no:cacheprovider -q -rfE \
    --tb=short "$@"
