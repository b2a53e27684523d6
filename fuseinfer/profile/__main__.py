"""Entry point: ``python -m fuseinfer.profile --model opt-1.3b --backend fuseinfer --compare eager --out prof/``."""
import sys

from fuseinfer.profile.cli import main

sys.exit(main())
