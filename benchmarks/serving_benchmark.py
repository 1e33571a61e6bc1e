"""benchmarks/serving.py as the module `bench`, for the scripts beside it that reuse its load generator, photos,
/proc readers and checkout helpers. `import serving` cannot name it: that is Petal's package."""
from __future__ import annotations

import importlib.util
import os
import sys

_spec = importlib.util.spec_from_file_location("serving_benchmark_script", os.path.join(os.path.dirname(__file__),
                                                                                       "serving.py"))
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up by name while the file runs
_spec.loader.exec_module(bench)
