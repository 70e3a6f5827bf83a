import sys

from mm_grpo.plan.cli import main

sys.exit(main())
