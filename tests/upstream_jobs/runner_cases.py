"""The runner's entry on each case of a JSON file, all in this one process (one torch + open_clip import).

    runner_cases.py CASES.json      (upstream's src first on PYTHONPATH)

CASES.json: a list of ``{"module": "naflex_accum.openclip" | "naflex_accum.cli", "argv": [...], "cwd": FOLDER,
"env": {NAME: VALUE or null}}``. Each case runs as its own process would: the module's ``main(argv)`` in
``cwd`` with ``env`` over this environment (null removes), its file descriptors 1 and 2 caught, warnings shown
afresh; an exception that escapes is printed as Python prints it (a traceback, exit 1). Prints one JSON list:
per case ``{"code": EXIT STATUS, "stdout": ..., "stderr": ...}``.
"""
import contextlib
import importlib
import json
import os
import sys
import tempfile
import traceback
import warnings


@contextlib.contextmanager
def _environment(cwd, env):
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


@contextlib.contextmanager
def _caught(streams):
    """File descriptors 1 and 2 (what C code and handlers bound to them write too) into ``streams`` as text."""
    files = {fd: tempfile.TemporaryFile(mode="w+") for fd in (1, 2)}
    saved = {fd: os.dup(fd) for fd in files}
    sys.stdout.flush(), sys.stderr.flush()
    for fd, file in files.items():
        os.dup2(file.fileno(), fd)
    try:
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        for fd, file in files.items():
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
            file.seek(0)
            streams[fd] = file.read()
            file.close()


def _run(case) -> int:
    main = importlib.import_module(case["module"]).main
    try:
        code = main(list(case["argv"]))
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 -- as the interpreter would end a process: the traceback, exit 1
        traceback.print_exc()
        return 1
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def main(path) -> None:
    results = []
    for case in json.loads(open(path).read()):
        streams = {}
        with _environment(case["cwd"], case.get("env", {})), warnings.catch_warnings(), _caught(streams):
            code = _run(case)
        results.append({"code": code, "stdout": streams[1], "stderr": streams[2]})
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
