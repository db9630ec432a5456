"""The conformance matrix: KerasHub model families trained under every tfdist strategy against one device.

`python3 dev.py conformance` (or `python -m conformance`) runs it and writes CONFORMANCE.md; see
`conformance/__main__.py`. `families.py` builds the models, `matrix.py` runs one family's cells.
"""
