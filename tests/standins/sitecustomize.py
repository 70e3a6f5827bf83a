"""Makes the test stand-ins (tests/testbed.py) effective in every Python process started with this
folder on PYTHONPATH (torchrun workers, `mm-convert` subprocesses)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.testbed import adapt_megatron_on_import, install_standins  # noqa: E402

install_standins()
adapt_megatron_on_import()  # MindSpeed-MM's environment: MindSpeed's adaptor before Megatron
