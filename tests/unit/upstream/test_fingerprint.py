"""upstream.fingerprint: stable for the same source, another one for any edit of the step or of the task's loss."""
import importlib.util

from naflex_accum.upstream.fingerprint import VERIFIED, describe, fingerprint, verified


def _load(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEP = "def step(x):\n    return x + 1\n"
TASK = "class Task:\n    def compute_accum_loss(self, a):\n        return a\n"


def test_stable_and_changed_by_an_edit_of_either_part(tmp_path):
    a = _load(tmp_path, "a", STEP + TASK)
    b = _load(tmp_path, "b", STEP + TASK)
    value = fingerprint(a.step, a.Task)
    assert len(value) == 16 and int(value, 16) >= 0 and fingerprint(b.step, b.Task) == value
    c = _load(tmp_path, "c", STEP.replace("+ 1", "+ 2") + TASK)
    d = _load(tmp_path, "d", STEP + TASK.replace("return a", "return a * 1"))
    assert len({value, fingerprint(c.step, c.Task), fingerprint(d.step, d.Task)}) == 3


def test_the_loss_is_looked_up_as_python_resolves_it_on_the_class(tmp_path):
    m = _load(tmp_path, "m", STEP + TASK + "class Child(Task):\n    pass\n"
              "class Own(Task):\n    def compute_accum_loss(self, a):\n        return -a\n")
    assert fingerprint(m.step, m.Child) == fingerprint(m.step, m.Task) != fingerprint(m.step, m.Own)


def test_without_source_the_name_still_tells_versions_apart():
    assert fingerprint(len, object) != fingerprint(abs, object)


def test_verified_table_and_description():
    known = next(iter(VERIFIED))
    assert verified(known) == VERIFIED[known] and verified("0" * 16) is None
    assert describe(known, "CLIPTask") == f"{known} (CLIPTask; verified in CI on {VERIFIED[known]})"
    assert "not among the upstream versions CI verified" in describe("0" * 16, "CLIPTask")
