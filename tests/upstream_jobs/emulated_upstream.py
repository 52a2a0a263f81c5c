"""An upstream open_clip that has moved on, emulated in this process, then a ``naflex-accum`` command on it.

    python emulated_upstream.py CHANGES naflex-accum-ARGS...      (upstream's src first on PYTHONPATH)

CHANGES is a comma-separated list (or ``none``) of what later upstream commits
may have done, each emulated by overriding upstream functions in this process,
none of upstream's code copied:

- ``window-scale``: open_clip PR #1212, one NaFlex loss scale per window: while
  upstream's own step closes a window, its ``get_naflex_loss_scale`` answers the
  window's scale for every replay;
- ``logit-once``: the "#761 detach fix": while upstream's own step closes a window,
  its model's ``logit_scale``/``logit_bias`` come back detached in every replay but
  the last, so they take their gradient once;
- ``task-object``: an unknown task contract: ``compute_accum_loss`` returns a
  ``StepLosses`` object;
- ``loop-five``: an unknown loop contract: ``train_one_epoch`` unpacks five values
  and upstream's step returns five;
- ``mixed``: parts that disagree: ``train_one_epoch`` unpacks three values while the
  tasks return ``(losses, report)``.

Upstream's step is wrapped with its own signature, so the patch's signature
check passes and the rest of the probe decides.
"""
import sys

import torch

WINDOW_SCALE, LOGIT_ONCE = "window-scale", "logit-once"


def _closing(accum_state, args) -> bool:
    return accum_state is not None and len(accum_state[0]) + 1 == args.accum_freq


def emulate_step_fixes(train, fixes):
    """Wrap upstream's step so that it closes each window with ``fixes`` in effect."""
    from naflex_accum.accum.scales import window_loss_scale
    from naflex_accum.accum.window import LOGIT_KEYS, is_naflex_batch
    from naflex_accum.tasks import unwrap

    original, scale_of = train._train_step_eager, train.get_naflex_loss_scale

    def _train_step_eager(task, batch, accum_state, optimizer, scaler, autocast, args):
        if not _closing(accum_state, args):
            return original(task, batch, accum_state, optimizer, scaler, autocast, args)
        window = [*accum_state[0], batch]
        handles = []
        if WINDOW_SCALE in fixes:
            sizes, naflex = [task.batch_size(b) for b in window], [is_naflex_batch(b) for b in window]
            train.get_naflex_loss_scale = lambda b, a, t: window_loss_scale(
                sizes, a.batch_size, getattr(a, "naflex_loss_scale", "none"), naflex=naflex)
        if LOGIT_ONCE in fixes:
            replays = [0]

            def detach_but_last(module, inputs, output):
                if not torch.is_grad_enabled():  # the caching forward
                    return None
                replays[0] += 1
                if replays[0] == len(window):
                    return None
                return {k: (v.detach() if k in LOGIT_KEYS else v) for k, v in output.items()}
            handles.append(unwrap(task.trainable_module).register_forward_hook(detach_but_last))
        try:
            return original(task, batch, accum_state, optimizer, scaler, autocast, args)
        finally:
            train.get_naflex_loss_scale = scale_of
            for handle in handles:
                handle.remove()
    train._train_step_eager = _train_step_eager


class StepLosses:
    def __init__(self, losses, report):
        self.losses, self.report = losses, report


def emulate_task_object():
    import open_clip.task as tasks

    base = tasks.CLIPTask.compute_accum_loss

    def compute_accum_loss(self, inputs, inputs_no_accum, accum_batches):
        return StepLosses(*base(self, inputs, inputs_no_accum, accum_batches))
    tasks.CLIPTask.compute_accum_loss = compute_accum_loss


def emulate_loop(train, values: int):
    """A ``train_one_epoch`` that unpacks ``values`` values, and (five) a step that returns that many."""
    original = train._train_step_eager

    def train_one_epoch_five(state, data, args, tb_writer=None):
        result = train._train_step_eager(None, None, None, None, None, None, args)
        losses, report, step_batch_size, accum_state, extra = result
        return losses

    def train_one_epoch_three(state, data, args, tb_writer=None):
        result = train._train_step_eager(None, None, None, None, None, None, args)
        losses, step_batch_size, accum_state = result
        return losses

    def _train_step_eager(task, batch, accum_state, optimizer, scaler, autocast, args):
        result = original(task, batch, accum_state, optimizer, scaler, autocast, args)
        return result if result is None else (*result, {})
    train.train_one_epoch = train_one_epoch_five if values == 5 else train_one_epoch_three
    if values == 5:
        train._train_step_eager = _train_step_eager


def main(argv):
    import open_clip_train.train as train

    changes = set(argv[0].split(",")) - {"none"}
    unknown = changes - {WINDOW_SCALE, LOGIT_ONCE, "task-object", "loop-five", "mixed"}
    assert not unknown, unknown
    if changes & {WINDOW_SCALE, LOGIT_ONCE}:
        emulate_step_fixes(train, changes)
    if "task-object" in changes:
        emulate_task_object()
    if "loop-five" in changes:
        emulate_loop(train, 5)
    if "mixed" in changes:
        emulate_loop(train, 3)
    from naflex_accum import cli

    return cli.entry(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
