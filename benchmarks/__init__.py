"""Benchmarks. `servebench/` is the library behind `continuum bench serve|compare`; the scripts
here (`python benchmarks/NAME.py --help`) measure one part each and share `harness.py` (server
start / stop, closed-loop load, summaries, `--save-result`); `results/` holds saved results."""
