"""Engine tests: the engines' own code from pinned releases (see fetch.py), GPU kernels faked."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
