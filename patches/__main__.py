"""``python -m patches --list``: the model families torchattn patches, and their status."""

import argparse

from .families import table

parser = argparse.ArgumentParser(prog="python -m patches", description=__doc__)
parser.add_argument("--list", action="store_true", help="print the family table")
args = parser.parse_args()
if not args.list:
    parser.error("nothing to do: pass --list")
print(table())
