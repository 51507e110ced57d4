# Sourced by the Megatron-LM launchers: require_imports PYTHON stops the launch with one clear line (exit 2)
# when that interpreter cannot import torch, megatron.core or megatron_dsv.
# shellcheck shell=bash
require_imports() {
    local missing
    if ! missing=$("$1" -c "
import importlib, sys
bad = []
for name in ('torch', 'megatron.core', 'megatron_dsv'):
    try:
        importlib.import_module(name)
    except Exception as e:
        bad.append(f'{name} ({type(e).__name__}: {e})')
print('; '.join(bad))
sys.exit(1 if bad else 0)" 2>/dev/null); then
        echo "error: $1 cannot import: ${missing:-torch}. Install torch, megatron-core and megatron_dsv" \
             "(pip install -e /path/to/megatron_dsv) in the environment of PYTHON" >&2
        exit 2
    fi
}
