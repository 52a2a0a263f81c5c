"""``naflex-accum verify --json`` on the pinned upstream, every case in one process (one torch + open_clip import).

Run with upstream's ``src`` first on PYTHONPATH. Prints one JSON list: per
case its arguments, exit status and report (``null`` when it printed none).
"""
import contextlib
import io
import json

from naflex_accum import cli
from naflex_accum.accum.modes import ACCUM_MODES
from naflex_accum.commands.verify import LOSSES

UPSTREAM_STEP = "open_clip_train.train:_train_step_eager"


def cases():
    for loss in LOSSES:
        for mode in ACCUM_MODES:
            yield ["--loss", loss, "--accum-mode", mode]
        yield ["--loss", loss, "--step", UPSTREAM_STEP]


def main():
    results = []
    for argv in cases():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli.main(["verify", "--json", *argv])
        text = out.getvalue().strip()
        results.append({"argv": argv, "code": code, "report": json.loads(text) if text else None})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
