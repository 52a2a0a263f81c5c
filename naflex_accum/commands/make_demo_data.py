"""``naflex-accum make-demo-data DIR``: synthetic image-caption webdataset shards for the demo.

Writes DIR/train and DIR/val shards with open_clip's sizes.json and prints the --train-data / --val-data
patterns; a non-empty DIR is refused unless --force. docs/data.md, "make-demo-data".
"""
import os
import time

from ..data.demo import write_demo_data
from ..errors import OneLineParser, UsageError, check_int


def main(argv, prog="naflex-accum make-demo-data", ends_process=False) -> int:
    parser = OneLineParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("dir", metavar="DIR", help="output folder (created if missing)")
    parser.add_argument("--num-samples", type=int, default=10000, help="training samples (default 10000)")
    parser.add_argument("--val-samples", type=int, default=1000, help="held-out samples (default 1000; 0: none)")
    parser.add_argument("--seed", type=int, default=0, help="seed; the held-out split uses its own stream")
    parser.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default 1000)")
    parser.add_argument("--processes", type=int, default=0, help="writer processes (default: CPU count)")
    parser.add_argument("--force", action="store_true", help="write into DIR even if it is not empty")
    args = parser.parse_args(argv)

    if os.path.exists(args.dir) and not os.path.isdir(args.dir):
        raise UsageError(f"DIR {args.dir!r} exists and is not a folder")
    if os.path.isdir(args.dir) and os.listdir(args.dir) and not args.force:
        raise UsageError(f"DIR {args.dir!r} is not empty; choose a new folder or pass --force to write into it")
    check_int(args.processes, "--processes", 0)
    start = time.time()
    out = write_demo_data(args.dir, num_samples=args.num_samples, val_samples=args.val_samples,
                          seed=args.seed, shard_size=args.shard_size, processes=args.processes)
    print(f"wrote {out.num_train} training and {out.num_val} held-out samples in {time.time() - start:.1f}s")
    print(f"--train-data '{out.train}'")
    if out.val:
        print(f"--val-data '{out.val}'")
    return 0
