#!/usr/bin/env python
"""Thin entry point: `python benchmarks/bench.py [flags]` == `python -m mori_torch.benchmark [flags]`."""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from mori_torch.benchmark import main

    sys.exit(main())
