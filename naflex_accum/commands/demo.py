"""``naflex-accum demo``: make the synthetic demo data once, train the tiny model on the CPU, show what it learnt.

Invariant: the demo data is written to a temporary sibling and renamed, so a cache folder that exists is
complete, and one without its marker is a user's, refused, never replaced; each run gets a new ``demo-<date>``
folder; ``train`` flags after the demo's own win over the ``demo`` preset. docs/training.md, "The demo".
"""
import os
from datetime import datetime
from pathlib import Path

from ..data.demo import write_demo_data
from ..data.index import cache_dir
from ..errors import OneLineParser, UsageError, check_int, writing
from ..helptext import DefaultsFormatter
from ..train.eval.zeroshot import load_class_list
from ..train.main import print_footer, train

DATA_VERSION = "v1"
ZERO_SHOT_CLASSES = "demo-shapes"  # naflex_accum/class_lists/demo-shapes.yaml: "a photo of a red triangle."


def default_data_dir() -> Path:
    return Path(cache_dir()) / f"demo-data-{DATA_VERSION}"


def ensure_demo_data(data_dir: Path, num_samples: int, val_samples: int) -> dict:
    data_dir = data_dir.absolute()  # '.' has no name for a sibling
    marker = data_dir / "patterns.txt"
    if os.path.lexists(data_dir) and not marker.is_file():  # never ours: ours is renamed into place whole
        raise UsageError(f"--data-dir {data_dir}: exists and is no demo data folder (it has no {marker.name}); give "
                         f"a folder that does not exist yet, which the demo writes, or one an earlier demo wrote")
    if not marker.is_file():
        tmp = data_dir.with_name(f".{data_dir.name}.tmp-{os.getpid()}")
        print(f"demo: writing {num_samples} training and {val_samples} held-out samples to {data_dir}")
        with writing(data_dir):  # a parent that is a file, or that cannot be made: one line
            patterns = write_demo_data(tmp, num_samples=num_samples, val_samples=val_samples, seed=0)
            (tmp / "patterns.txt").write_text(f"train={Path(patterns.train).relative_to(tmp)}\n"
                                              f"val={Path(patterns.val).relative_to(tmp)}\n")
            data_dir.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, data_dir)
    entries = dict(line.split("=", 1) for line in marker.read_text().split())
    return {k: str(data_dir / v) for k, v in entries.items()}


ROWS = (("held-out image->text R@1 / R@5", "image_to_text_R@1", "image_to_text_R@5"),
        ("held-out text->image R@1 / R@5", "text_to_image_R@1", "text_to_image_R@5"),
        ("zero-shot top-1 / top-5", "{}-zeroshot-val-top1", "{}-zeroshot-val-top5"))


def summarize(result: dict) -> None:
    """Loss, and held-out retrieval and zero-shot accuracy before training and after the last epoch."""
    if not result["is_master"]:
        return
    print("\nDemo summary")
    if result["first_loss"] is not None and result["epoch_losses"]:
        print(f"  training loss: first step {result['first_loss']:.4f} -> last epoch average "
              f"{result['epoch_losses'][-1]:.4f}")
    if not result["evals"]:
        return
    classes = load_class_list(ZERO_SHOT_CLASSES)
    (first, before), (last, after) = result["evals"][0], result["evals"][-1]
    print(f"  {'':<32}{f'before (epoch {first})':>18}{f'after (epoch {last})':>18}")
    for label, *keys in ROWS:
        keys = [k.format(classes.name) for k in keys]
        cells = [" / ".join(f"{m[k]:.3f}" for k in keys) if all(k in m for k in keys) else "-" for m in (before, after)]
        print(f"  {label:<32}{cells[0]:>18}{cells[1]:>18}")
    n = len(classes.classnames)
    print(f"  chance: R@1 {1 / max(1, result['val_samples']):.4f}; zero-shot over {n} colour-shape classes "
          f"{1 / n:.3f} / {min(5, n) / n:.3f}")


def build_parser(prog="naflex-accum demo") -> OneLineParser:
    parser = OneLineParser(prog=prog, description=__doc__.splitlines()[0], formatter_class=DefaultsFormatter,
                           epilog="Other arguments are passed to naflex-accum train and win over the preset.")
    parser.add_argument("--data-dir", type=Path, default=default_data_dir(), help="demo data cache folder")
    parser.add_argument("--num-samples", type=int, default=10000, help="training samples to generate")
    parser.add_argument("--val-samples", type=int, default=1000, help="held-out samples to generate")
    parser.add_argument("--logs", default="./logs", help="parent folder of the run folder")
    parser.add_argument("--name", default=None, help="run folder name (default: demo-<date>)")
    return parser


def main(argv, prog="naflex-accum demo", ends_process=False) -> int:
    args, train_flags = build_parser(prog).parse_known_args(argv)
    check_int(args.val_samples, "--val-samples")  # the demo evaluates on them

    patterns = ensure_demo_data(args.data_dir, args.num_samples, args.val_samples)
    name = args.name or f"demo-{datetime.now().strftime('%Y_%m_%d-%H_%M_%S')}"
    # Zero-shot on the held-out split before training and after the preset's last epoch (5).
    result = train(["--config", "demo", "--train-data", patterns["train"], "--val-data", patterns["val"],
                    "--val-at-start", "--zeroshot-classes", ZERO_SHOT_CLASSES, "--zeroshot-frequency", "5",
                    "--logs", args.logs, "--name", name, *train_flags], "naflex-accum demo", ends_process)
    summarize(result)
    print_footer(result)
    return result["exit_code"]
