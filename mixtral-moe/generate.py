# Generates text with a Mixtral checkpoint by running the root generate.py with the same
# arguments: the model code is shared (README.md here).
#
#   python mixtral-moe/generate.py --help
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    script = Path(__file__).resolve().parents[1] / "generate.py"
    os.execv(sys.executable, [sys.executable, str(script), *sys.argv[1:]])
