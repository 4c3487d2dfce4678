#!/usr/bin/env python3
"""The static model's tables for docs/perf.md (flash_ext.roofline): predictions for the GPU benchmark grid
and the decode-tile what-if, on A100/H100/H200.  Needs a built extension (CPU-only is enough).

    python scripts/roofline_tables.py                      # grid table
    python scripts/roofline_tables.py --decode-tiles       # what-if decode tiles
    python scripts/roofline_tables.py --update docs/perf.md  # rewrite both between their markers
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from flash_ext import roofline  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", nargs="+", default=sorted(roofline.GPUS), help="GPUs to model (default: all known)")
    ap.add_argument("--decode-tiles", action="store_true", help="the decode what-if table")
    ap.add_argument("--update", help="markdown file whose <!-- PRED_TABLE --> / <!-- DECODE_TABLE --> blocks to rewrite")
    args = ap.parse_args()
    if not args.update:
        print(roofline._decode_tiles_table(args.gpu) if args.decode_tiles else roofline._grid_table(args.gpu))
        return 0
    path = pathlib.Path(args.update)
    doc = path.read_text()
    for marker, table in (("PRED_TABLE", roofline._grid_table(args.gpu)),
                          ("DECODE_TABLE", roofline._decode_tiles_table(args.gpu))):
        start, end = doc.index(f"<!-- {marker} -->"), doc.index(f"<!-- /{marker} -->")
        doc = doc[:start] + f"<!-- {marker} -->\n" + table + "\n" + doc[end:]
    path.write_text(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
