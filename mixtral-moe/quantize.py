# Quantizes a Mixtral checkpoint (int8, int4 or fp8 experts; the router stays float) by running
# the root quantize.py with the same arguments: the model code is shared (README.md here).
#
#   python mixtral-moe/quantize.py --help
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    script = Path(__file__).resolve().parents[1] / "quantize.py"
    os.execv(sys.executable, [sys.executable, str(script), *sys.argv[1:]])
