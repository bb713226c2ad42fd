"""main.py with the tests' forks installed as experiments (tests/*_fork.py), for tests that run them
in several processes: `launch/local.py --main=tests/main_with_forks.py -- MAIN_FLAGS...`."""

import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests import batchnorm_fork, contrastive_fork  # noqa: E402

for fork in (batchnorm_fork, contrastive_fork):
  fork.install()
runpy.run_path(os.path.join(REPO, "main.py"), run_name="__main__")
