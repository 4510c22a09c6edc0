"""``python -m kvmesh``: the ``kvmesh`` command (``kvmesh.cli.main``)."""

import sys

from kvmesh.cli.main import main

sys.exit(main())
