"""`scripts/pretend_gpu/run PYTHON SCRIPT [ARGS]` runs this: the pretend kernels, then SCRIPT as __main__."""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pretend_gpu  # noqa: E402

pretend_gpu.install()
script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
