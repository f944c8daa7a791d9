# Converts a Mixtral checkpoint (HF safetensors, or Mistral's params.json and consolidated files)
# by running the root scripts/convert_hf_checkpoint.py with the same arguments: the model code is
# shared (README.md here).
#
#   python mixtral-moe/scripts/convert_hf_checkpoint.py --help
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    script = Path(__file__).resolve().parents[2] / "scripts/convert_hf_checkpoint.py"
    os.execv(sys.executable, [sys.executable, str(script), *sys.argv[1:]])
