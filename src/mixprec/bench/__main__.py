"""``python -m mixprec.bench SPEC_JSON OUT_JSON``: one bench worker (see :mod:`mixprec.bench.worker`).

The runner starts workers through this entry point rather than ``-m mixprec.bench.worker``: the
package ``__init__`` already imports the worker module, which ``runpy`` would then run a second
time (with a RuntimeWarning in every worker's log).
"""

import sys

from mixprec.bench.worker import main

sys.exit(main())
