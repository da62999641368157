"""Spark tests: real PySpark ``local[2]`` on the local stack.

Executors' Python workers must import twophase, and PySpark picks their interpreter from
``PYSPARK_PYTHON`` when the context is created. Set here at collection time, before the session
fixture of ``tests/conftest.py`` can run.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
