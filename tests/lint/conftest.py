"""Linter lane: no torch, no Triton (the linter never imports them).

The lane's folder is on sys.path: test modules share helpers by module name (``from test_lint_oracle import ...``).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
