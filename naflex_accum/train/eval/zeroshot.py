"""Zero-shot classification during training, as open_clip's ``zero_shot_eval``, on local labelled images.

Invariants: every labelled image once, eval mode under no_grad on the unwrapped model, train mode after;
open_clip's class embeddings, logits, top-1/top-5 and metric names. An unreadable sample is skipped and
counted in a warning; a set with no usable sample is an error. docs/training.md, "Zero-shot classification".
"""
import logging
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import yaml
from open_clip import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, build_zero_shot_classifier
from open_clip.tokenizer import SimpleTokenizer

from ...data import (SHOWN_PROBLEMS, FolderSource, LabelledBatches, Problems, ShardSource, expand_urls,
                     normalize_patches)
from ...errors import UsageError
from ...models import takes_flat_patches
from ...tasks import unwrap

log = logging.getLogger(__name__)
CLASS_LIST_DIR = Path(__file__).resolve().parents[2] / "class_lists"


def due(epoch: int, frequency: int, epochs: int) -> bool:
    """Upstream's rule: every ``frequency`` epochs and after the last one; never when ``frequency`` is 0."""
    return bool(frequency) and (epoch % frequency == 0 or epoch == epochs)


def add_args(parser) -> None:
    e = parser.add_argument_group("evaluation (open_clip's flags, and a local zero-shot set)")
    e.add_argument("--val-frequency", type=int, default=1, metavar="N",
                   help="held-out retrieval every N epochs and after the last (0: never)")
    e.add_argument("--zeroshot-frequency", type=int, default=2, metavar="N",
                   help="zero-shot classification every N epochs and after the last (0: never)")
    e.add_argument("--zeroshot-classes", default=None, metavar="FILE",
                   help="class list for --zeroshot-data: a YAML/JSON file with classnames and templates "
                        "(or a name in naflex_accum/class_lists, e.g. demo-shapes)")
    e.add_argument("--zeroshot-data", default=None, metavar="SHARDS",
                   help="labelled webdataset shards for --zeroshot-classes (a '.cls' index, or '.json' fields, per "
                        "sample) (default: --val-data)")
    e.add_argument("--imagenet-val", default=None, metavar="DIR",
                   help="ImageNet val folder (one subfolder per class) for zero-shot")
    e.add_argument("--imagenet-v2", default=None, metavar="DIR",
                   help="ImageNetV2 folder (subfolders 0..999) for zero-shot")



class ClassList(NamedTuple):
    name: str
    classnames: List[str]
    templates: List[str]
    json_label: Optional[str] = None  # e.g. "{colour} {shape}": a sample's class from its .json fields


def resolve_class_list(spec: str) -> Path:
    path = Path(spec)
    if path.suffix.lower() not in (".yaml", ".yml", ".json"):
        path = CLASS_LIST_DIR / f"{spec}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CLASS_LIST_DIR.glob("*.yaml")))
        raise UsageError(f"--zeroshot-classes {spec!r}: no such file; built-in class lists are {known}, "
                         f"or pass a YAML/JSON path")
    return path


def _string_list(data: dict, key: str, where: str) -> List[str]:
    values = data.get(key)
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and v.strip() for v in values):
        raise UsageError(f"{where}: '{key}' must be a non-empty list of non-empty strings")
    return values


def load_class_list(spec: str) -> ClassList:
    """A class list: ``classnames``, ``templates`` (each with one '{}'), optional ``name`` and ``json_label``."""
    path = resolve_class_list(spec)
    where = f"--zeroshot-classes {path}"
    try:
        data = yaml.safe_load(path.read_text())  # YAML reads JSON too
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where}: not valid YAML/JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a mapping with 'classnames' and 'templates'")
    unknown = sorted(set(data) - {"name", "classnames", "templates", "json_label"})
    if unknown:
        raise UsageError(f"{where}: unknown keys {unknown}; valid keys: name, classnames, templates, json_label")
    classnames, templates = _string_list(data, "classnames", where), _string_list(data, "templates", where)
    if len(set(classnames)) != len(classnames):
        raise UsageError(f"{where}: 'classnames' has duplicates")
    if len(classnames) < 2:
        raise UsageError(f"{where}: zero-shot classification needs at least 2 classnames")
    bad = [t for t in templates if t.count("{}") != 1 or t.replace("{}", "").count("{")]
    if bad:
        raise UsageError(f"{where}: each template needs exactly one '{{}}' for the class name; got {bad[0]!r}")
    json_label = data.get("json_label")
    if json_label is not None and (not isinstance(json_label, str) or "{" not in json_label):
        raise UsageError(f"{where}: 'json_label' must be a format string of .json fields, e.g. '{{colour}} {{shape}}'")
    name = str(data.get("name") or path.stem)
    return ClassList(name, classnames, templates, json_label)



def accuracy(logits: torch.Tensor, target: torch.Tensor, topk=(1,)) -> List[float]:
    """Correct predictions among the top k, for each k: open_clip's ``accuracy`` (3.3.0's fails under numpy 2)."""
    pred = logits.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [correct[:k].reshape(-1).float().sum().item() for k in topk]


class ZeroShotSet(NamedTuple):
    prefix: str  # metric names are f"{prefix}-zeroshot-val-top1" / "-top5"
    classnames: List[str]
    templates: List[str]
    source: object
    flag: str


def image_sets(args) -> List[ZeroShotSet]:
    """The zero-shot sets the flags ask for (validated, nothing read but folder listings)."""
    sets = []
    if args.zeroshot_classes:
        classes = load_class_list(args.zeroshot_classes)
        flag = "--zeroshot-data" if args.zeroshot_data else "--val-data"
        urls = expand_urls(args.zeroshot_data or args.val_data, flag)
        sets.append(ZeroShotSet(classes.name, classes.classnames, classes.templates,
                                ShardSource(urls, classes.classnames, classes.json_label, flag), flag))
    for flag, prefix, numeric in (("--imagenet-val", "imagenet", False), ("--imagenet-v2", "imagenetv2", True)):
        root = getattr(args, flag[2:].replace("-", "_"))
        if root:
            source = FolderSource(root, flag, numeric, len(IMAGENET_CLASSNAMES))
            sets.append(ZeroShotSet(prefix, list(IMAGENET_CLASSNAMES), list(OPENAI_IMAGENET_TEMPLATES), source, flag))
    return sets


def validate(args) -> None:
    if args.zeroshot_data and not args.zeroshot_classes:
        raise UsageError("--zeroshot-data needs --zeroshot-classes FILE: the class names and prompt templates")
    if args.zeroshot_classes:
        load_class_list(args.zeroshot_classes)
        if not (args.zeroshot_data or args.val_data):
            raise UsageError("--zeroshot-classes needs labelled images: --zeroshot-data SHARDS (or --val-data)")


class ZeroShot:
    """Zero-shot top-1/top-5 of every set, when ``--zeroshot-frequency`` says so."""

    def __init__(self, sets: List[ZeroShotSet], tokenizer, args, device):
        self.sets, self.tokenizer, self.device = sets, tokenizer, device
        self.frequency, self.epochs, self.workers = args.zeroshot_frequency, args.epochs, args.workers
        self.seq_len = args.val_seq_len or max(args.naflex_seq_lens)
        self.patch_size, self.batch_size = args.naflex_patch_sizes[0], args.val_batch_size
        self.decode, self.flatten = args.image_decode, takes_flat_patches(args.naflex_patch_sizes)

    def batches(self, source) -> Iterator:
        stream = LabelledBatches(source, self.seq_len, self.patch_size, self.batch_size, self.decode, self.flatten)
        workers = min(self.workers, len(source) // 2)  # a worker is worth starting only with work to share
        if workers < 2:
            return iter(stream)
        return iter(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers))

    @torch.no_grad()
    def evaluate_set(self, model, zs: ZeroShotSet, autocast) -> Tuple[float, float]:
        with autocast():
            classifier = build_zero_shot_classifier(model, self.tokenizer, zs.classnames, zs.templates,
                                                    num_classes_per_batch=10, device=self.device)
        top = (1, min(5, len(zs.classnames)))
        correct, seen, skipped = [0.0, 0.0], 0, Problems()
        for images, labels in self.batches(zs.source):
            if images is None:  # a worker's skipped samples
                skipped.count += labels.count
                skipped.first += labels.first[:SHOWN_PROBLEMS - len(skipped.first)]
                continue
            images = normalize_patches({k: v.to(self.device, non_blocking=True) for k, v in images.items()})
            with autocast():
                features = model.encode_image(images, normalize=True)
            logits = 100.0 * features.float() @ classifier.float()
            for i, hits in enumerate(accuracy(logits, labels.to(self.device), topk=top)):
                correct[i] += hits
            seen += len(labels)
        if skipped.count:
            log.warning(f"{zs.flag}: skipped {skipped.count} samples; first: {'; '.join(skipped.first)}")
        if not seen:
            raise UsageError(f"{zs.flag}: no usable labelled images for zero-shot classification")
        return correct[0] / seen, correct[1] / seen

    def due(self, epoch: int) -> bool:
        return due(epoch, self.frequency, self.epochs)

    def __call__(self, task, epoch: int, autocast) -> Dict[str, float]:
        if not self.due(epoch):
            return {}
        model = unwrap(task.trainable_module)
        was_training = model.training
        model.eval()
        metrics = {}
        try:
            for zs in self.sets:
                top1, top5 = self.evaluate_set(model, zs, autocast)
                metrics[f"{zs.prefix}-zeroshot-val-top1"] = top1
                metrics[f"{zs.prefix}-zeroshot-val-top5"] = top5
        finally:
            model.train(was_training)
        return metrics


def make_zero_shot(args, model, world, device) -> Optional[ZeroShot]:
    """The run's zero-shot evaluator on rank 0 (None elsewhere, or when no set is asked for)."""
    if not world.is_master:
        return None
    sets = image_sets(args)
    if not sets:
        return None
    return ZeroShot(sets, SimpleTokenizer(context_length=model.context_length), args, device)
