"""Entry point: ``python -m fuseinfer.eval --model opt-1.3b --backends eager,compile,fuseinfer --dtype fp16``."""
import sys

from fuseinfer.eval.cli import main

sys.exit(main())
