"""``python -m mixprec.programs.bench SPEC_JSON OUT_JSON``: one bench worker (see :mod:`mixprec.programs.bench.worker`);
``python -m mixprec.programs.bench --serve SPEC_JSON``: a resident timing worker (:mod:`mixprec.programs.bench.interleaved`);
``python -m mixprec.programs.bench --turns SPEC_JSON OUT_JSON``: a one-pass worker (:mod:`mixprec.programs.bench.turns`).

The runner starts workers through this entry point rather than ``-m mixprec.programs.bench.worker``: the
package ``__init__`` already imports the worker module, which ``runpy`` would then run a second
time (with a RuntimeWarning in every worker's log).
"""

import json
import sys

if len(sys.argv) == 3 and sys.argv[1] == "--serve":   # a resident timing worker (mixprec.programs.bench.interleaved)
    from mixprec.programs.bench.interleaved import serve
    from mixprec.programs.bench.worker import RunSpec

    with open(sys.argv[2], encoding="utf-8") as f:
        sys.exit(serve(RunSpec(**json.load(f))))

if len(sys.argv) == 4 and sys.argv[1] == "--turns":   # a one-pass worker (mixprec.programs.bench.turns)
    from pathlib import Path

    from mixprec.programs.bench.turns import serve_training
    from mixprec.programs.bench.worker import RunSpec

    with open(sys.argv[2], encoding="utf-8") as f:
        sys.exit(serve_training(RunSpec(**json.load(f)), Path(sys.argv[3])))

from mixprec.programs.bench.worker import main

sys.exit(main())
