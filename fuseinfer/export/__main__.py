"""Entry point: ``python -m fuseinfer.export onnx --model opt-1.3b --out DIR`` (see cli.py)."""
import sys

from fuseinfer.export.cli import main

sys.exit(main())
